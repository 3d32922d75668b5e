"""MkDocs hook (mkdocs.yml `hooks:`): the architecture page's diagram of patchkit's parts, drawn as SVG when
the site is built from the import rules on that same page, and the home page's diagram of the processes.

The rules table of docs/architecture.md (between the markers that tests/test_layout.py reads, which checks
every import of the code against it) names each unit and the units it may import at run time; the diagram
draws one box per unit and one arrow per allowed import, the leaves (which every unit may import) named
under it. So the picture changes with the table, and the table with the code. Both pictures are laid out
by patchkit's own renderer (`patchkit.capture.render.draw_svg`), the one that draws pipeline graphs: the
site loads no diagram script, from its own host or another.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchkit.capture.render import Arrow, Shape, draw_svg

MARKER = "<!-- the diagram of the units, made by docs/hooks/architecture_diagram.py -->"
PROCESSES_MARKER = "<!-- the diagram of the processes, made by docs/hooks/architecture_diagram.py -->"
DOCS = Path(__file__).resolve().parents[1]
UNITS_SVG, PROCESSES_SVG = "img/architecture.svg", "img/processes.svg"
BEGIN, END = "<!-- import rules: read by tests/test_layout.py -->", "<!-- end of import rules -->"
NAME = re.compile(r"`([\w.]+)`")


@dataclass(frozen=True)
class Unit:
    """One row of the rules table: a unit, whether it is a leaf, and what it may import at run time."""

    name: str
    leaf: bool
    imports: tuple[str, ...]


def units(page: str) -> list[Unit]:
    """The rows of the rules table in `page` (the architecture page's markdown), in the table's order."""
    start, end = page.index(BEGIN), page.index(END)
    rows = [line for line in page[start:end].splitlines() if line.startswith("| `")]
    found = []
    for row in rows:
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        found.append(Unit(NAME.findall(cells[0])[0], cells[1] == "leaf", tuple(NAME.findall(cells[2]))))
    return found


def _id(name: str) -> str:
    return name.replace(".", "_")


def _short(name: str) -> str:
    return name.removeprefix("patchkit.") if name != "patchkit" else name


def svg(rows: list[Unit]) -> str:
    """The units as boxes, an arrow from each unit to each unit (or single module of one) it may import, the
    leaves named under the picture."""
    known = {unit.name for unit in rows}
    shapes = {unit.name: Shape(_id(unit.name), _short(unit.name)) for unit in rows if not unit.leaf}
    arrows = []
    for unit in rows:
        for target in unit.imports:
            owner = max((name for name in known if target == name or target.startswith(name + ".")), key=len, default=None)
            if owner is None:  # outside the table (examples/, installed as patchkit.examples)
                shapes.setdefault(target, Shape(_id(target), _short(target), "outside patchkit/"))
                owner = target
            label = f"{target.removeprefix(owner + '.')} only" if owner != target else ""
            arrows.append(Arrow(_id(unit.name), _id(owner), label))
    leaves = ", ".join(_short(unit.name) for unit in rows if unit.leaf)
    legend = [(None, "an arrow: what a unit may import at run time"), (None, f"every unit may import the leaves: {leaves}")]
    return draw_svg(list(shapes.values()), arrows, legend)


# The home page's picture: which process runs what, and what passes between them.
_PROCESSES = [
    Shape("code", "components, capture(), deploy()", "your process"),
    Shape("endpoint", "Endpoint", "your process"),
    Shape("runner", "your pipeline code, once per request", "front-end process"),
    Shape("policies", "the SLO policies, the autoscaler", "front-end process"),
    Shape("queues", "a batching queue per method", "front-end process"),
    Shape("worker", "setup() once, then batched calls over gRPC", "workers: a process per replica, or a Ray actor"),
]
_FLOWS = [
    Arrow("code", "runner", "starts"),
    Arrow("endpoint", "runner", "HTTP"),
    Arrow("runner", "queues"),
    Arrow("policies", "queues", dashed=True),
    Arrow("queues", "worker", "batches"),
]


def processes_svg() -> str:
    """The processes patchkit runs, their parts, and the arrows between them."""
    return draw_svg(_PROCESSES, _FLOWS, [(None, "dashed: the policies reorder the queues and add replicas")])


def on_files(files: Any, config: Any) -> Any:
    """Called by MkDocs once the documentation files are collected: both pictures become files of the site."""
    from mkdocs.structure.files import File

    page = (DOCS / "architecture.md").read_text()
    files.append(File.generated(config, UNITS_SVG, content=svg(units(page))))
    files.append(File.generated(config, PROCESSES_SVG, content=processes_svg()))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Called by MkDocs for every page before it is rendered: the marker lines become the pictures."""
    markdown = markdown.replace(MARKER, f"![The units of patchkit and what each may import]({UNITS_SVG})")
    return markdown.replace(PROCESSES_MARKER, f"![patchkit's processes and what passes between them]({PROCESSES_SVG})")
