"""MkDocs hook (mkdocs.yml `hooks:`): the architecture page's diagram of patchkit's parts, drawn as Mermaid
when the site is built from the import rules on that same page.

The rules table of docs/architecture.md (between the markers that tests/test_layout.py reads, which checks
every import of the code against it) names each unit and the units it may import at run time; the diagram
draws one box per unit and one arrow per allowed import, the leaves (which every unit may import) grouped
apart. So the picture changes with the table, and the table with the code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

MARKER = "<!-- the diagram of the units, made by docs/hooks/architecture_diagram.py -->"
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


def mermaid(rows: list[Unit]) -> str:
    """A Mermaid flowchart: an arrow from each unit to each unit (or single module of one) it may import."""
    known = {unit.name for unit in rows}
    lines = ["flowchart TD", '    subgraph leaves["leaves: every unit may import them"]']
    lines += [f'        {_id(unit.name)}["{_short(unit.name)}"]' for unit in rows if unit.leaf]
    lines.append("    end")
    lines += [f'    {_id(unit.name)}["{_short(unit.name)}"]' for unit in rows if not unit.leaf]
    for unit in rows:
        for target in unit.imports:
            owner = max((name for name in known if target == name or target.startswith(name + ".")), key=len, default=None)
            if owner is None:  # outside the table (examples/, installed as patchkit.examples)
                lines.append(f'    {_id(target)}["{_short(target)}"]')
                owner = target
            label = f"|{target.removeprefix(owner + '.')} only|" if owner != target else ""
            lines.append(f"    {_id(unit.name)} -->{label} {_id(owner)}")
    return "\n".join(lines)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Called by MkDocs for every page before it is rendered: the marker line becomes the diagram."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, f"```mermaid\n{mermaid(units(markdown))}\n```")
