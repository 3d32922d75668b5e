"""The site's pictures are made from the code when it is built: each example's pipeline graph, the package
diagram, the benchmark plots and tables. These tests call the hooks (docs/hooks/) as MkDocs does, without
building the site, and fail when a picture would be missing from it or a result file lacks its provenance."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("mkdocs", reason="the documentation site is built with MkDocs (the dev extra)")
pytest.importorskip("matplotlib", reason="the benchmark plots are drawn with matplotlib (the bench extra)")

from mkdocs.config import load_config  # noqa: E402
from mkdocs.structure.files import Files  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"_docs_hook_{name}", DOCS / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as MkDocs loads a hook: its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def config() -> Any:
    return load_config(str(ROOT / "mkdocs.yml"))


@pytest.fixture(scope="module")
def site(config: Any) -> dict[str, str]:
    """The files the hooks add to the site, as MkDocs asks them once it has collected the pages: each one's
    path in the site and its content."""
    files = config.plugins.on_files(Files([]), config=config)
    return {file.src_uri: file.content_string for file in files if not file.src_uri.endswith(".png")}  # text files


def rendered(module: ModuleType, page: str) -> str:
    return module.on_page_markdown((DOCS / page).read_text(), None, None, None)


def test_the_hooks_are_listed_in_mkdocs_yml() -> None:
    listed = (ROOT / "mkdocs.yml").read_text()
    for name in ("options", "example_graphs", "architecture_diagram", "benchmark_results"):
        assert f"docs/hooks/{name}.py" in listed, name


def test_every_example_has_its_graph_in_the_site(site: dict[str, str]) -> None:
    graphs = hook("example_graphs")
    made = site
    page = rendered(graphs, "examples.md")
    examples = sorted(path.stem for path in (ROOT / "examples").glob("*.py") if not path.name.startswith("_"))
    assert examples
    for example in examples:
        uri = f"img/examples/{example}.svg"  # the pipeline `patchkit serve` serves
        assert uri in made, f"no graph of examples/{example}.py in the site"
        assert made[uri].lstrip().startswith("<svg") and "</svg>" in made[uri]
        assert f"]({uri})" in page, f"the Examples page does not show {uri}"
    assert graphs.MARKER not in page


def test_every_benchmark_plot_is_in_the_site(site: dict[str, str]) -> None:
    benchmarks = hook("benchmark_results")
    results = benchmarks.load_results(ROOT)
    made = site
    page = rendered(benchmarks, "benchmarks.md")
    assert {result.data["components"] for result in results} == {"simulated", "real models"}
    for result in results:
        assert result.data.get("plots"), f"benchmarks/results/{result.name}.json has no plot"
        for index in range(len(result.data["plots"])):
            uri = result.plot_uri(index)
            assert uri in made and "<svg" in made[uri], f"no plot {uri} in the site"
            assert f"]({uri})" in page, f"the Benchmarks page does not show {uri}"
        assert f"commit `{result.data['commit']}`" in page
    simulated, real = page.index("## Simulated components"), page.index("## Real models")
    for result in results:  # each under its own heading
        at = page.index(f"### {result.data['title']}\n")
        assert (simulated < at < real) == (result.data["components"] == "simulated"), result.name
    assert "<!-- benchmark results" not in page


@pytest.mark.parametrize("key", ["machine", "date", "commit", "command"])
def test_a_result_file_without_its_provenance_is_refused(key: str, tmp_path: Path) -> None:
    benchmarks = hook("benchmark_results")
    source = json.loads((ROOT / "benchmarks" / "results" / "slo.json").read_text())
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    del source[key]
    (tmp_path / "benchmarks" / "results" / "slo.json").write_text(json.dumps(source))
    with pytest.raises(ValueError, match=f"slo.json lacks {key}"):
        benchmarks.load_results(tmp_path)


def test_the_architecture_diagram_draws_every_unit_of_the_import_rules(site: dict[str, str]) -> None:
    diagram = hook("architecture_diagram")
    page = rendered(diagram, "architecture.md")
    assert f"]({diagram.UNITS_SVG})" in page and diagram.MARKER not in page
    svg = site[diagram.UNITS_SVG]
    units = diagram.units((DOCS / "architecture.md").read_text())
    assert len(units) > 10
    leaves = re.search(r"every unit may import the leaves: ([^<]*)<", svg)
    assert leaves is not None
    for unit in units:
        name = diagram._short(unit.name)
        assert (name in leaves.group(1).split(", ")) if unit.leaf else (f">{name}<" in svg), unit.name
    home = rendered(diagram, "index.md")
    assert f"]({diagram.PROCESSES_SVG})" in home and "<svg" in site[diagram.PROCESSES_SVG]


_SCRIPT_ELSEWHERE = re.compile(r"<script[^>]*\bsrc=[\"']?(https?:)?//", re.I)


def _pages_as_built() -> dict[str, str]:
    """Every page's markdown after every hook's on_page_markdown, as MkDocs renders it."""
    hooks = [hook(name) for name in ("options", "example_graphs", "architecture_diagram", "benchmark_results", "reference")]
    pages = {}
    for path in sorted(DOCS.rglob("*.md")):
        text = path.read_text()
        for module in hooks:
            if hasattr(module, "on_page_markdown"):
                text = module.on_page_markdown(text, None, None, None)
        pages[str(path.relative_to(DOCS))] = text
    return pages


def test_no_page_loads_a_script_from_another_host(config: Any) -> None:
    """A page reads offline and without another host: no script from elsewhere, no Mermaid (the theme loads
    Mermaid's script from a CDN for a mermaid block), no web fonts."""
    for entry in config["extra_javascript"]:
        assert "//" not in str(entry), f"mkdocs.yml extra_javascript loads {entry} from another host"
    fences = config["mdx_configs"].get("pymdownx.superfences", {}).get("custom_fences", [])
    assert not [fence for fence in fences if "mermaid" in str(fence)], "mkdocs.yml turns mermaid blocks into diagrams"
    assert config["theme"]["font"] is False, "the theme loads its fonts from Google's host"
    for name, text in _pages_as_built().items():
        assert "```mermaid" not in text and 'class="mermaid"' not in text, f"{name} draws a Mermaid diagram"
        assert not _SCRIPT_ELSEWHERE.search(text), f"{name} loads a script from another host"



def test_the_dashboard_page_says_so_when_its_screenshot_cannot_be_made(monkeypatch: pytest.MonkeyPatch) -> None:
    shot = hook("dashboard_screenshot")
    assert "docs/hooks/dashboard_screenshot.py" in (ROOT / "mkdocs.yml").read_text()
    monkeypatch.setattr(shot, "chromium", lambda: None)
    shot.on_pre_build(None)
    assert not list(shot.on_files(Files([]), config=None))
    page = rendered(shot, "dashboard.md")
    assert shot.MARKER not in page
    assert '!!! note "No screenshot in this build"' in page and "Chromium is not installed" in page
