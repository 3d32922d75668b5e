"""MkDocs hook (mkdocs.yml `hooks:`): the benchmark page's tables and plots, made when the site is built from
the result files committed under benchmarks/results/.

Each file is one benchmark's run: its title, whether its components were `simulated` (they sleep or do
nothing, so only patchkit's own work is real) or `real models`, the machine, the date, the commit and the
command that measured it, what it ran (`setup`), its tables (the numbers as benchmarks/README.md gives
them) and its plots (the same numbers as series). The plots are drawn with matplotlib (the `bench` extra)
as SVG into the built site (`img/benchmarks/*.svg`), never into the repository; the page's two marker lines
become the simulated and the real-model results.
"""

from __future__ import annotations

import functools
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
IMAGES = "img/benchmarks"
KINDS = {"simulated": "simulated", "real": "real models"}
MARKERS = {kind: f"<!-- benchmark results, {kind}, made by docs/hooks/benchmark_results.py -->" for kind in KINDS.values()}
REQUIRED = ("title", "components", "machine", "date", "commit", "command", "setup", "tables")
PLOT_KINDS = ("bar", "barh", "line")


@dataclass(frozen=True)
class Result:
    """One result file: its name (the file's stem) and its data, checked to hold what the page shows."""

    name: str
    data: dict[str, Any]

    def plot_uri(self, index: int) -> str:
        return f"{IMAGES}/{self.name}-{index + 1}.svg"


def check(name: str, data: dict[str, Any]) -> None:
    """Raise ValueError naming the file and what it lacks: every field the page shows, and well-formed tables
    and plots (as many cells as columns; as many values as labels)."""
    where = f"benchmarks/results/{name}.json"
    missing = [key for key in REQUIRED if not data.get(key)]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    if data["components"] not in KINDS.values():
        raise ValueError(f"{where}: components is {data['components']!r}, not one of {sorted(KINDS.values())}")
    for table in data["tables"]:
        for row in table["rows"]:
            if len(row) != len(table["columns"]):
                raise ValueError(f"{where}: a row of {len(row)} cells under {len(table['columns'])} columns: {row}")
    for plot in data.get("plots", []):
        if plot.get("kind") not in PLOT_KINDS:
            raise ValueError(f"{where}: plot kind {plot.get('kind')!r}, not one of {PLOT_KINDS}")
        for series, values in plot["series"].items():
            if len(values) != len(plot["x"]):
                raise ValueError(f"{where}: series {series!r} has {len(values)} values for {len(plot['x'])} labels")


@functools.cache
def load_results(root: Path = ROOT) -> tuple[Result, ...]:
    """Every benchmarks/results/*.json, checked, in name order."""
    found = []
    for path in sorted((root / "benchmarks" / "results").glob("*.json")):
        data = json.loads(path.read_text())
        check(path.stem, data)
        found.append(Result(path.stem, data))
    return tuple(found)


def plot_svg(plot: dict[str, Any]) -> str:
    """One plot of a result file as SVG text, the same bytes for the same data (no date, a fixed hash salt)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"svg.hashsalt": "patchkit", "svg.fonttype": "none", "font.size": 10}):
        labels, series = [str(x) for x in plot["x"]], plot["series"]
        horizontal = plot["kind"] == "barh"
        fig, ax = plt.subplots(figsize=(7.0, 1.2 + 0.45 * len(labels)) if horizontal else (7.0, 3.6))
        if plot["kind"] == "line":
            for name, values in series.items():
                ax.plot(plot["x"], values, marker="o", label=name)
        else:
            width = 0.8 / len(series)
            for i, (name, values) in enumerate(series.items()):
                at = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
                (ax.barh if horizontal else ax.bar)(at, values, width, label=name)
            (ax.set_yticks if horizontal else ax.set_xticks)(range(len(labels)), labels)
            if horizontal:
                ax.invert_yaxis()
        if plot.get("log"):
            (ax.set_xscale if horizontal else ax.set_yscale)("log")
        ax.set_title(plot["title"])
        ax.set_xlabel(plot.get("xlabel", ""))
        ax.set_ylabel(plot.get("ylabel", ""))
        ax.grid(axis="x" if horizontal else "y", alpha=0.3)
        if len(series) > 1:
            ax.legend()
        fig.tight_layout()
        out = io.StringIO()
        fig.savefig(out, format="svg", metadata={"Date": None})
        plt.close(fig)
    return out.getvalue()


@functools.cache
def plot_files(root: Path = ROOT) -> dict[str, str]:
    """Every plot of every result file: its path in the site and its SVG."""
    return {
        result.plot_uri(i): plot_svg(plot) for result in load_results(root) for i, plot in enumerate(result.data.get("plots", []))
    }


def _cell(value: str) -> str:
    return str(value).replace("|", "\\|")


def markdown(results: tuple[Result, ...], components: str) -> str:
    """The sections of the results whose components are `components`: what ran, where, and the numbers."""
    parts: list[str] = []
    for result in results:
        data = result.data
        if data["components"] != components:
            continue
        parts += [
            f"### {data['title']}",
            "",
            f"{data['machine']}, {data['date']}, commit `{data['commit']}`:",
            "",
            f"```bash\n{data['command']}\n```",
            "",
            data["setup"],
            "",
        ]
        for i, plot in enumerate(data.get("plots", [])):
            parts += [f"![{plot['title']}]({result.plot_uri(i)})", ""]
        for table in data["tables"]:
            parts += [table.get("caption", ""), ""] if table.get("caption") else []
            parts.append("| " + " | ".join(_cell(c) for c in table["columns"]) + " |")
            parts.append("|" + " --- |" * len(table["columns"]))
            parts += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in table["rows"]]
            parts.append("")
    return "\n".join(parts)


def on_pre_build(config: Any) -> None:
    """Called by MkDocs before each build: `mkdocs serve` rebuilds with what the files hold now."""
    load_results.cache_clear()
    plot_files.cache_clear()


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    """Called by `mkdocs serve`: an edit of benchmarks/results/ rebuilds the site too."""
    server.watch(str(ROOT / "benchmarks" / "results"))
    return server


def on_files(files: Any, config: Any) -> Any:
    """Called by MkDocs once the documentation files are collected: each plot becomes a file of the site."""
    from mkdocs.structure.files import File

    for uri, svg in plot_files().items():
        files.append(File.generated(config, uri, content=svg))
    return files


def on_page_markdown(markdown_text: str, page: Any, config: Any, files: Any) -> str:
    """Called by MkDocs for every page before it is rendered: each marker line becomes its results."""
    for components, marker in MARKERS.items():
        if marker in markdown_text:
            markdown_text = markdown_text.replace(marker, markdown(load_results(), components))
    return markdown_text
