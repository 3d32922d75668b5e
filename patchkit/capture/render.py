"""Pictures of a pipeline graph: DOT and Mermaid text, and a self-contained SVG for Jupyter.

The SVG is laid out here (layers by longest path, back edges of loops drawn as arcs), so a
notebook shows the graph without Graphviz installed. All three fill the calls of one overlap group
(calls a request may have in flight together) with one colour from a small cycling palette.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from patchkit.capture.graph import Edge, Graph

__all__ = ["to_dot", "to_mermaid", "to_svg"]

_W, _H, _GAP_X, _GAP_Y, _MARGIN = 170, 44, 36, 70, 24
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


def _layers(ids: list[str], edges: list[Edge]) -> tuple[dict[str, int], set[tuple[str, str]]]:
    """Layer of each node by longest path, after dropping the back edges of a depth-first search."""
    out: dict[str, list[str]] = {i: [] for i in ids}
    for e in edges:
        if e.src in out and e.dst in out and e.dst not in out[e.src]:
            out[e.src].append(e.dst)
    back: set[tuple[str, str]] = set()
    state: dict[str, int] = {}
    order: list[str] = []

    def visit(u: str) -> None:
        state[u] = 1
        for v in out[u]:
            if state.get(v) == 1:
                back.add((u, v))
            elif v not in state:
                visit(v)
        state[u] = 2
        order.append(u)

    for i in ids:
        if i not in state:
            visit(i)
    layer = {i: 0 for i in ids}
    for u in reversed(order):
        for v in out[u]:
            if (u, v) not in back:
                layer[v] = max(layer[v], layer[u] + 1)
    return layer, back


def to_svg(graph: Graph) -> str:
    """A standalone SVG picture of the graph; overlap groups are fills, explained under the lowest row."""
    ids = _all_ids(graph)
    layer, back = _layers(ids, graph.edges)
    rows: dict[int, list[str]] = {}
    for node_id in ids:
        rows.setdefault(layer[node_id], []).append(node_id)
    width = max((len(r) for r in rows.values()), default=1) * (_W + _GAP_X) + 2 * _MARGIN + 80
    pos: dict[str, tuple[float, float]] = {}
    for y, row in rows.items():
        span = len(row) * (_W + _GAP_X) - _GAP_X
        x0 = (width - 80 - span) / 2
        for k, node_id in enumerate(row):
            pos[node_id] = (x0 + k * (_W + _GAP_X), _MARGIN + y * (_H + _GAP_Y))
    height = (max(rows, default=0) + 1) * (_H + _GAP_Y) + 2 * _MARGIN
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
        'font-family="Helvetica, Arial, sans-serif" font-size="12">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#555"/></marker></defs>',
    ]
    parts += _svg_loops(graph, pos)
    parts += [_svg_edge(e, pos, (e.src, e.dst) in back) for e in graph.edges if e.src in pos and e.dst in pos]
    overlap, alone = _overlap_of(graph), _alone(graph)
    for node_id in ids:
        fill = _fill(overlap[node_id]) if node_id in overlap else "#ffffff"
        parts.append(_svg_node(graph, node_id, pos[node_id], fill, stacked=node_id in alone))
    parts += _svg_legend(graph, height)
    parts.append("</svg>")
    return "\n".join(parts)


def _svg_legend(graph: Graph, height: float) -> list[str]:
    """Lines under the lowest row (in the bottom gap every picture has) saying what the fills mean."""
    lines = ["calls in the same colour may be in flight together"] if graph.overlap_groups else []
    lines += [f"a stacked box: {_SEVERAL} of one call"] if _alone(graph) else []
    return [
        f'<text x="{_MARGIN}" y="{height - _MARGIN - 30 + 15 * k:.0f}" fill="#444" font-size="11">{line}</text>'
        for k, line in enumerate(lines)
    ]


def _svg_loops(graph: Graph, pos: dict[str, tuple[float, float]]) -> list[str]:
    out = []
    for loop_id, loop in graph.loops.items():
        members = [pos[n.id] for n in graph.nodes.values() if loop_id in n.loops and n.id in pos]
        if not members:
            continue
        x0 = min(x for x, _ in members) - 12
        y0 = min(y for _, y in members) - 22
        x1 = max(x for x, _ in members) + _W + 12
        y1 = max(y for _, y in members) + _H + 10
        out.append(
            f'<rect x="{x0:.0f}" y="{y0:.0f}" width="{x1 - x0:.0f}" height="{y1 - y0:.0f}" rx="10" '
            'fill="#f4f8ff" stroke="#7a9cc6" stroke-dasharray="5 3"/>'
            f'<text x="{x0 + 8:.0f}" y="{y0 + 14:.0f}" fill="#46648c">{html.escape(loop.kind)} (line {loop.lineno})</text>'
        )
    return out


def _svg_edge(edge: Edge, pos: dict[str, tuple[float, float]], is_back: bool) -> str:
    (sx, sy), (dx, dy) = pos[edge.src], pos[edge.dst]
    dash = ' stroke-dasharray="5 4"' if edge.kind == "control" else ""
    color = "#b0632a" if edge.kind == "control" else "#555"
    if is_back or sy >= dy:
        x1, y1, x2, y2 = sx + _W, sy + _H / 2, dx + _W, dy + _H / 2
        bulge = max(x1, x2) + 50
        path = f"M {x1:.0f} {y1:.0f} C {bulge:.0f} {y1:.0f}, {bulge:.0f} {y2:.0f}, {x2:.0f} {y2:.0f}"
        mid = (bulge - 10, (y1 + y2) / 2)
    else:
        x1, y1, x2, y2 = sx + _W / 2, sy + _H, dx + _W / 2, dy
        path = f"M {x1:.0f} {y1:.0f} L {x2:.0f} {y2:.0f}"
        mid = ((x1 + x2) / 2 + 4, (y1 + y2) / 2)
    label = (
        f'<text x="{mid[0]:.0f}" y="{mid[1]:.0f}" fill="{color}" font-size="10">{html.escape(edge.label)}</text>'
        if edge.label
        else ""
    )
    return f'<path d="{path}" fill="none" stroke="{color}"{dash} marker-end="url(#arrow)"/>{label}'


def _svg_node(graph: Graph, node_id: str, at: tuple[float, float], fill: str, stacked: bool) -> str:
    x, y = at
    cx, cy = x + _W / 2, y + _H / 2
    title, sub = _text(graph, node_id)
    if node_id in graph.nodes:
        box = f'width="{_W}" height="{_H}" rx="6" fill="{fill}" stroke="#333"'
        shape = f'<rect x="{x + 5:.0f}" y="{y - 5:.0f}" {box}/>' if stacked else ""
        shape += f'<rect x="{x:.0f}" y="{y:.0f}" {box}/>'
    else:
        shape = f'<ellipse cx="{cx:.0f}" cy="{cy:.0f}" rx="{_W / 2:.0f}" ry="{_H / 2:.0f}" fill="#eef5ea" stroke="#4d7a3a"/>'
    middle = f'x="{cx:.0f}" text-anchor="middle"'
    text = f'<text {middle} y="{y + (18 if sub else 27):.0f}" font-weight="bold">{html.escape(title)}</text>'
    if sub:
        text += f'<text {middle} y="{y + 34:.0f}" fill="#666" font-size="10">{html.escape(sub)}</text>'
    return shape + text
