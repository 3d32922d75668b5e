"""Pictures of a pipeline graph: DOT and Mermaid text, and a self-contained SVG for Jupyter and the docs.

The SVG is laid out by `layout.py` (ranks by dependency, parallel branches side by side, long edges
routed between boxes, labels where nothing covers them), so a notebook shows the graph without
Graphviz installed; `draw_svg` draws any such picture of boxes and arrows (the docs draw their
diagrams with it too). All three fill the calls of one overlap group (calls a request may have in
flight together) with one colour from a small cycling palette.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from patchkit.capture.layout import LABEL_H, layered

if TYPE_CHECKING:
    from patchkit.capture.graph import Graph

__all__ = ["Arrow", "Shape", "draw_svg", "to_dot", "to_mermaid", "to_svg"]

_H, _ELLIPSE_H, _STACK, _MARGIN = 44.0, 40.0, 5.0, 20.0
_DATA, _CONTROL = "#555555", "#b0632a"
_OVERLAP_FILLS = ("#ffe0b2", "#d4efd4", "#e3d5f5", "#ffd4dc", "#cfe8f7", "#f3efb0")
_SEVERAL = "several in flight"  # the note on a call that overlaps with itself (a group of one)


def _input_id(name: str) -> str:
    return f"input:{name}"


def _text(graph: Graph, node_id: str) -> tuple[str, str]:
    """(title, subtitle) of a node."""
    if node_id.startswith("input:"):
        return node_id[6:], "input"
    if node_id == "output":
        return "output", ""
    node = graph.nodes[node_id]
    visits = f" · {node.visits}x" if graph.runs else ""
    return node.label, f"{node.cls} · line {node.site.lineno}{visits}"


def _lines(graph: Graph, node_id: str) -> list[str]:
    """Label lines of a node in DOT and Mermaid: title, subtitle, and the note on a group of one."""
    title, sub = _text(graph, node_id)
    return [title] + ([sub] if sub else []) + ([_SEVERAL] if node_id in _alone(graph) else [])


def _overlap_of(graph: Graph) -> dict[str, int]:
    """Index in `graph.overlap_groups` of the group each call is in (calls outside every group are absent)."""
    return {node_id: i for i, group in enumerate(graph.overlap_groups) for node_id in group}


def _alone(graph: Graph) -> set[str]:
    """Calls that overlap with themselves: a loop issues several before the first result is needed."""
    return {group[0] for group in graph.overlap_groups if len(group) == 1}


def _fill(group: int) -> str:
    return _OVERLAP_FILLS[group % len(_OVERLAP_FILLS)]


def _all_ids(graph: Graph) -> list[str]:
    ids = [_input_id(n) for n in graph.inputs] + list(graph.nodes)
    if any(e.dst == "output" for e in graph.edges):
        ids.append("output")
    return ids


def _by_loop(graph: Graph) -> dict[str | None, list[str]]:
    """Node ids grouped by their innermost loop (None: outside any loop), for clusters and subgraphs."""
    groups: dict[str | None, list[str]] = {}
    for node_id in _all_ids(graph):
        node = graph.nodes.get(node_id)
        groups.setdefault(node.loops[-1] if node is not None and node.loops else None, []).append(node_id)
    return groups


def to_dot(graph: Graph) -> str:
    """Graphviz DOT text: calls are boxes, inputs and output ellipses, control edges dashed; the calls
    of an overlap group share a fill and are joined by dotted undirected "overlap" edges."""
    overlap = _overlap_of(graph)
    lines = ["digraph pipeline {", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=11];']
    for loop_id, members in _by_loop(graph).items():
        indent = "  "
        if loop_id is not None:
            loop = graph.loops[loop_id]
            lines.append(f'  subgraph "cluster_{loop_id}" {{')
            lines.append(f'    label="{loop.kind} (line {loop.lineno})"; style=dashed;')
            indent = "    "
        for node_id in members:
            shape = "box" if node_id in graph.nodes else "ellipse"
            fill = f', style="filled,bold", fillcolor="{_fill(overlap[node_id])}"' if node_id in overlap else ""
            label = _dot_escape("\\n".join(_lines(graph, node_id)))
            lines.append(f'{indent}"{node_id}" [shape={shape}, label="{label}"{fill}];')
        if loop_id is not None:
            lines.append("  }")
    for edge in graph.edges:
        attrs = (["style=dashed"] if edge.kind == "control" else []) + (
            [f'label="{_dot_escape(edge.label)}"'] if edge.label else []
        )
        lines.append(f'  "{edge.src}" -> "{edge.dst}"' + (f" [{', '.join(attrs)}]" if attrs else "") + ";")
    for group in graph.overlap_groups:
        for a, b in zip(group, group[1:]):
            lines.append(f'  "{a}" -> "{b}" [style=dotted, dir=none, constraint=false, label="overlap"];')
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_escape(text: str) -> str:
    return text.replace('"', '\\"')


def _mermaid_id(node_id: str) -> str:
    return node_id.replace(":", "_")


def to_mermaid(graph: Graph) -> str:
    """Mermaid flowchart text; loops are subgraphs and control edges dotted arrows. The calls of overlap
    group i have class `overlap<i>` (a fill) and are joined by dotted undirected "overlap" links: a
    node sits in its loop's subgraph already, and subgraphs cannot share nodes."""
    lines = ["flowchart TD"]
    for loop_id, members in _by_loop(graph).items():
        if loop_id is not None:
            loop = graph.loops[loop_id]
            lines.append(f'  subgraph {loop_id}["{loop.kind} (line {loop.lineno})"]')
        for node_id in members:
            label = "<br/>".join(html.escape(line, quote=True) for line in _lines(graph, node_id))
            shape = ('["', '"]') if node_id in graph.nodes else ('(["', '"])')
            lines.append(f"    {_mermaid_id(node_id)}{shape[0]}{label}{shape[1]}")
        if loop_id is not None:
            lines.append("  end")
    for edge in graph.edges:
        arrow = "-.->" if edge.kind == "control" else "-->"
        label = f"|{edge.label}|" if edge.label else ""
        lines.append(f"  {_mermaid_id(edge.src)} {arrow}{label} {_mermaid_id(edge.dst)}")
    for i, group in enumerate(graph.overlap_groups):
        lines.append(f"  classDef overlap{i} fill:{_fill(i)},stroke:#333,stroke-width:2px")
        lines.append(f"  class {','.join(_mermaid_id(n) for n in group)} overlap{i}")
        lines += [f"  {_mermaid_id(a)} -.-|overlap| {_mermaid_id(b)}" for a, b in zip(group, group[1:])]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Shape:
    """A box of a picture: a title, an optional smaller line under it, its fill; an ellipse for an input
    or output; `stacked` draws a second box behind it (several of one call in flight)."""

    id: str
    title: str
    subtitle: str = ""
    fill: str = "#ffffff"
    ellipse: bool = False
    stacked: bool = False


@dataclass(frozen=True)
class Arrow:
    """An edge of a picture, from one shape's id to another's, with an optional label; dashed for control."""

    src: str
    dst: str
    label: str = ""
    dashed: bool = False


def text_width(text: str, size: float, bold: bool = False) -> float:
    """A generous estimate of a text's width in Helvetica at `size` px (no font metrics at hand)."""
    return len(text) * size * (0.64 if bold else 0.6)


def _size(shape: Shape) -> tuple[float, float]:
    width = max(text_width(shape.title, 12, bold=True), text_width(shape.subtitle, 10)) + 28
    width = max(width, 110.0) + (_STACK if shape.stacked else 0.0)
    return width, (_ELLIPSE_H if shape.ellipse else _H) + (_STACK if shape.stacked else 0.0)


def draw_svg(shapes: list[Shape], arrows: list[Arrow], legend: Sequence[tuple[str | None, str]] = ()) -> str:
    """A standalone SVG of `shapes` joined by `arrows`, laid out in ranks (`layout.layered`); `legend`
    lines, each with the fill of its swatch (or None), go under the picture.

    The SVG marks what it draws for readers and tests: `class="node"` on each box (a rect or an ellipse),
    `class="edge"` on each arrow's path, `class="label"` on an arrow's label and the rect behind it,
    `class="legend"` on the legend."""
    known = {shape.id for shape in shapes}
    arrows = [a for a in arrows if a.src in known and a.dst in known]
    sizes = {shape.id: _size(shape) for shape in shapes}
    spans = [(a.src, a.dst, text_width(a.label, 10) + 6 if a.label else 0.0) for a in arrows]
    layout = layered(sizes, spans)
    legend_w = max((text_width(line, 11) + 40 for _, line in legend), default=0.0)
    width, height = max(layout.width, legend_w + 2 * _MARGIN), layout.height + 18 * len(legend)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="Helvetica, Arial, sans-serif" font-size="12">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="context-stroke"/></marker></defs>',
    ]
    for arrow, route, label in zip(arrows, layout.routes, layout.labels):
        parts.append(_svg_arrow(arrow, route, label))
    for shape in shapes:
        parts.append(_svg_shape(shape, layout.boxes[shape.id], sizes[shape.id]))
    for k, (fill, line) in enumerate(legend):
        y = layout.height + 18 * k
        swatch = (
            f'<rect class="legend" x="{_MARGIN:.0f}" y="{y:.0f}" width="14" height="12" fill="{fill}" stroke="#333"/>'
            if fill
            else ""
        )
        parts.append(
            f'{swatch}<text class="legend" x="{_MARGIN + 22:.0f}" y="{y + 10:.0f}" fill="#444" font-size="11">'
            f"{html.escape(line)}</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts)


def _svg_arrow(arrow: Arrow, route: list[tuple[float, float]], label: tuple[float, float, float, float] | None) -> str:
    color = _CONTROL if arrow.dashed else _DATA
    dash = ' stroke-dasharray="5 4"' if arrow.dashed else ""
    path = " ".join(f"{'M' if k == 0 else 'L'} {x:.1f} {y:.1f}" for k, (x, y) in enumerate(route))
    out = f'<path class="edge" d="{path}" fill="none" stroke="{color}"{dash} marker-end="url(#arrow)"/>'
    if label is not None:
        x, y, w, h = label
        out += (
            f'<rect class="label" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" fill="#ffffff" '
            f'fill-opacity="0.85"/><text class="label" x="{x + 3:.1f}" y="{y + LABEL_H - 3.5:.1f}" fill="{color}" '
            f'font-size="10">{html.escape(arrow.label)}</text>'
        )
    return out


def _rect_size(w: float, h: float) -> str:
    return f'width="{w:.1f}" height="{h:.1f}"'


def _svg_shape(shape: Shape, at: tuple[float, float], size: tuple[float, float]) -> str:
    x, y = at
    w, h = size
    if shape.stacked:  # the box in front sits low and left; the one behind peeks out above and right
        w, h = w - _STACK, h - _STACK
        behind = f'<rect x="{x + _STACK:.1f}" y="{y:.1f}" {_rect_size(w, h)} rx="6" fill="{shape.fill}" stroke="#333"/>'
        y += _STACK
    else:
        behind = ""
    cx, cy = x + w / 2, y + h / 2
    if shape.ellipse:
        box = (
            f'<ellipse class="node" cx="{cx:.1f}" cy="{cy:.1f}" rx="{w / 2:.1f}" ry="{h / 2:.1f}" '
            f'fill="{shape.fill}" stroke="#4d7a3a"/>'
        )
    else:
        box = f'<rect class="node" x="{x:.1f}" y="{y:.1f}" {_rect_size(w, h)} rx="6" fill="{shape.fill}" stroke="#333"/>'
    middle = f'x="{cx:.1f}" text-anchor="middle"'
    title_y = cy - 3 if shape.subtitle else cy + 4
    text = f'<text {middle} y="{title_y:.1f}" font-weight="bold">{html.escape(shape.title)}</text>'
    if shape.subtitle:
        text += f'<text {middle} y="{cy + 12:.1f}" fill="#666" font-size="10">{html.escape(shape.subtitle)}</text>'
    return behind + box + text


def to_svg(graph: Graph) -> str:
    """A standalone SVG picture of the graph (`draw_svg`): a box per call, titled with its component and
    method, its class, line and innermost loop under it; inputs and the output as ellipses; data edges solid,
    control edges dashed with their condition; the calls of an overlap group in one fill, a call that
    overlaps with itself stacked, and a legend under the picture saying what the fills mean."""
    overlap, alone = _overlap_of(graph), _alone(graph)
    shapes = []
    for node_id in _all_ids(graph):
        title, sub = _text(graph, node_id)
        node = graph.nodes.get(node_id)
        if node is None:
            shapes.append(Shape(node_id, title, sub, "#eef5ea", ellipse=True))
            continue
        if node.loops and node.loops[-1] in graph.loops:
            loop = graph.loops[node.loops[-1]]
            sub += f" · in {loop.kind} L{loop.lineno}"
        fill = _fill(overlap[node_id]) if node_id in overlap else "#ffffff"
        shapes.append(Shape(node_id, title, sub, fill, stacked=node_id in alone))
    return draw_svg(shapes, _arrows(graph), _legend(graph))


def _arrows(graph: Graph) -> list[Arrow]:
    """One arrow per source, destination and kind of edge, its label the edges' labels joined."""
    labels: dict[tuple[str, str, str], list[str]] = {}
    for e in graph.edges:
        labels.setdefault((e.src, e.dst, e.kind), [])
        if e.label and e.label not in labels[(e.src, e.dst, e.kind)]:
            labels[(e.src, e.dst, e.kind)].append(e.label)
    return [Arrow(src, dst, ", ".join(text), kind == "control") for (src, dst, kind), text in labels.items()]


def _legend(graph: Graph) -> list[tuple[str | None, str]]:
    """The lines under a picture: what each fill means, the stacked box, the dashed edges."""
    lines: list[tuple[str | None, str]] = []
    for i, group in enumerate(graph.overlap_groups):
        if len(group) > 1:
            names = ", ".join(graph.nodes[n].label if n in graph.nodes else n for n in group)
            lines.append((_fill(i), f"may be in flight together: {names}"))
        else:
            label = graph.nodes[group[0]].label if group[0] in graph.nodes else group[0]
            lines.append((_fill(i), f"a stacked box: {_SEVERAL} of one call ({label})"))
    if lines:
        lines.insert(0, (None, "calls in the same colour may be in flight together"))
    if any(e.kind == "control" for e in graph.edges):
        lines.append((None, "dashed: the call runs only when the condition on the edge holds"))
    return lines
