"""The graph pictures read: in the SVG `Graph.to_svg()` writes, no edge runs through a box other than its
own two, and no edge label lies under a box or another label.

The check reads the SVG as a browser draws it, in paint order, without relying on how the picture was
made: boxes are the stroked rects and ellipses (a dashed rect is a frame, not a box), edges the paths that
end in an arrow, an edge's label the text painted after it (and after the rect behind it). Labels' extents
come from their font size, 0.6 em per character. It runs over every example's graph, captured as the docs
capture them, and over random graphs with parallel branches, long edges, labels, loops and overlap groups.
"""

from __future__ import annotations

import importlib.util
import random
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from patchkit.capture.graph import Graph, Loop, Node
from patchkit.core import CallSite

ROOT = Path(__file__).resolve().parent.parent
Rect = tuple[float, float, float, float]  # x0, y0, x1, y1
_SVG = "{http://www.w3.org/2000/svg}"


def _float(element: ET.Element, name: str, default: float = 0.0) -> float:
    return float(element.get(name, default))


def _path_points(d: str) -> list[tuple[float, float]]:
    """The points of an absolute M/L/C path, a cubic curve sampled at 16 steps."""
    tokens = re.findall(r"[MLC]|-?\d+(?:\.\d+)?", d)
    points: list[tuple[float, float]] = []
    command, k = "M", 0
    while k < len(tokens):
        if tokens[k] in "MLC":
            command, k = tokens[k], k + 1
            continue
        if command == "C":
            p1, p2, p3 = ((float(tokens[k + 2 * j]), float(tokens[k + 2 * j + 1])) for j in range(3))
            p0 = points[-1]
            for step in range(1, 17):
                t = step / 16
                a, b, c, e = (1 - t) ** 3, 3 * (1 - t) ** 2 * t, 3 * (1 - t) * t**2, t**3
                points.append((a * p0[0] + b * p1[0] + c * p2[0] + e * p3[0], a * p0[1] + b * p1[1] + c * p2[1] + e * p3[1]))
            k += 6
        else:
            points.append((float(tokens[k]), float(tokens[k + 1])))
            k += 2
    return points


def _text_rect(element: ET.Element) -> Rect:
    size = _float(element, "font-size", 12)
    width = len(element.text or "") * size * 0.6
    x, y = _float(element, "x"), _float(element, "y")
    anchor = element.get("text-anchor", "start")
    x0 = x - width / 2 if anchor == "middle" else x - width if anchor == "end" else x
    return (x0, y - 0.8 * size, x0 + width, y + 0.2 * size)


def read_picture(svg: str) -> tuple[list[Rect], list[list[tuple[float, float]]], list[tuple[str, Rect]]]:
    """The boxes, the edges' points and the edge labels (text and rect) of an SVG picture, in paint order."""
    boxes: list[Rect] = []
    edges: list[list[tuple[float, float]]] = []
    labels: list[tuple[str, Rect]] = []
    owner = ""
    root = ET.fromstring(svg)
    skip = {id(e) for defs in root.iter(f"{_SVG}defs") for e in defs.iter()}
    for element in root.iter():
        if id(element) in skip:
            continue
        tag, kind = element.tag.removeprefix(_SVG), element.get("class", "")
        if kind == "legend":
            owner = "legend"
        elif tag == "path" and element.get("marker-end"):
            edges.append(_path_points(element.get("d", "")))
            owner = "edge"
        elif tag == "rect" and kind != "label":
            if element.get("stroke-dasharray"):
                owner = "frame"  # a frame drawn around boxes: its title is a label
                continue
            x, y = _float(element, "x"), _float(element, "y")
            boxes.append((x, y, x + _float(element, "width"), y + _float(element, "height")))
            owner = "box"
        elif tag == "ellipse":
            cx, cy, rx, ry = (_float(element, a) for a in ("cx", "cy", "rx", "ry"))
            boxes.append((cx - rx, cy - ry, cx + rx, cy + ry))
            owner = "box"
        elif tag == "text" and owner in ("edge", "frame"):
            labels.append((element.text or "", _text_rect(element)))
    return boxes, edges, labels


def _crosses(a: tuple[float, float], b: tuple[float, float], box: Rect, inset: float = 0.5) -> bool:
    """Whether segment a-b enters the inside of `box` (Liang-Barsky clipping)."""
    x0, y0, x1, y1 = box[0] + inset, box[1] + inset, box[2] - inset, box[3] - inset
    dx, dy = b[0] - a[0], b[1] - a[1]
    lo, hi = 0.0, 1.0
    for p, q in ((-dx, a[0] - x0), (dx, x1 - a[0]), (-dy, a[1] - y0), (dy, y1 - a[1])):
        if p == 0:
            if q < 0:
                return False
        elif p < 0:
            lo = max(lo, q / p)
        else:
            hi = min(hi, q / p)
    return lo < hi


def _overlap(a: Rect, b: Rect) -> bool:
    return min(a[2], b[2]) - max(a[0], b[0]) > 0.5 and min(a[3], b[3]) - max(a[1], b[1]) > 0.5


def _holds(box: Rect, point: tuple[float, float], slack: float = 2.0) -> bool:
    return box[0] - slack <= point[0] <= box[2] + slack and box[1] - slack <= point[1] <= box[3] + slack


def shortfalls(svg: str) -> list[str]:
    """Every edge segment through a box other than its ends', every label under a box or another label."""
    boxes, edges, labels = read_picture(svg)
    found = []
    for k, points in enumerate(edges):
        own = [box for box in boxes if _holds(box, points[0]) or _holds(box, points[-1])]
        for a, b in zip(points, points[1:]):
            for box in boxes:
                if box not in own and _crosses(a, b, box):
                    found.append(f"edge {k} crosses the box at ({box[0]:.0f}, {box[1]:.0f})")
    for j, (text, rect) in enumerate(labels):
        found += [f"label {text!r} lies under the box at ({box[0]:.0f}, {box[1]:.0f})" for box in boxes if _overlap(rect, box)]
        found += [f"labels {text!r} and {other!r} overlap" for other, rest in labels[j + 1 :] if _overlap(rect, rest)]
    return found


def _hook() -> Any:
    spec = importlib.util.spec_from_file_location("_docs_hook_example_graphs", ROOT / "docs" / "hooks" / "example_graphs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


HOOK = _hook()
EXAMPLES = HOOK.example_graphs()


@pytest.mark.parametrize("graph", EXAMPLES, ids=[f"{g.example}-{g.name}" for g in EXAMPLES])
def test_each_example_graph_reads(graph: Any) -> None:
    assert graph.calls > 0, f"examples/{graph.example}.py: {graph.name}'s graph shows none of its calls"
    boxes, edges, _ = read_picture(graph.svg)
    assert len(boxes) >= graph.calls + 2 and edges
    assert shortfalls(graph.svg) == []


def random_graph(seed: int) -> Graph:
    """A graph as a capture makes them: inputs, calls, data and control edges (labelled), the output, a loop's
    way back and a call fed by itself, overlap groups; parallel branches and edges that skip ranks."""
    rng = random.Random(seed)
    graph = Graph([f"q{k}" for k in range(rng.randint(1, 2))])
    calls = [f"n{k}" for k in range(rng.randint(3, 11))]
    names = ["retriever", "llm", "grader", "rewriter", "search"]
    for k, node_id in enumerate(calls):
        component = f"{rng.choice(names)}{k}"
        graph.nodes[node_id] = Node(node_id, component, component.title(), "call", CallSite("p.py", 10 + k, 4, 30))
    sources = [f"input:{name}" for name in graph.inputs]
    for node_id in calls:
        for src in rng.sample(sources, min(len(sources), rng.randint(1, 3))):
            if rng.random() < 0.25:
                graph.add_edge(src, node_id, "control", rng.choice(["if L12", "while L30", "for L7", "except L9"]))
            else:
                graph.add_edge(src, node_id, "data", rng.choice(["", "", "part"]))
        sources.append(node_id)
    for node_id in rng.sample(calls, 2):
        graph.add_edge(node_id, "output", "data", rng.choice(["", "part"]))
    later, earlier = sorted(rng.sample(calls, 2), key=calls.index, reverse=True)
    graph.add_edge(later, earlier, "data")  # a loop's way back
    graph.add_edge(later, later, "data")
    graph.loops["loop1"] = Loop("loop1", "for", "p.py", 3)
    graph.nodes[earlier].loops.append("loop1")
    graph.overlap_groups = [tuple(rng.sample(calls[:-1], 2)), (calls[-1],)]
    return graph


@pytest.mark.parametrize("seed", range(40))
def test_random_graphs_read(seed: int) -> None:
    graph = random_graph(seed)
    svg = graph.to_svg()
    boxes, edges, labels = read_picture(svg)
    assert len(edges) == len({(e.src, e.dst, e.kind) for e in graph.edges})  # parallel edges drawn as one
    assert {text for text, _ in labels} == {
        ", ".join(dict.fromkeys(x.label for x in graph.edges if (x.src, x.dst, x.kind) == (e.src, e.dst, e.kind) and x.label))
        for e in graph.edges
        if e.label
    }
    assert shortfalls(svg) == []
    assert svg == random_graph(seed).to_svg()  # the same picture every time


def test_the_check_finds_an_edge_through_a_box_and_a_covered_label() -> None:
    """The check itself: a picture whose edge runs through a third box, and whose label lies under a box."""
    svg = (
        '<svg xmlns="http://www.w3.org/2000/svg">'
        '<path d="M 50 10 L 50 200" marker-end="url(#a)"/><text x="40" y="110" font-size="10">if L3</text>'
        '<rect x="0" y="0" width="100" height="10" stroke="#333"/>'
        '<rect x="0" y="100" width="100" height="20" stroke="#333"/>'
        '<rect x="0" y="200" width="100" height="10" stroke="#333"/></svg>'
    )
    found = shortfalls(svg)
    assert found == ["edge 0 crosses the box at (0, 100)", "label 'if L3' lies under the box at (0, 100)"]


def test_overlap_groups_are_coloured_and_explained() -> None:
    graph = random_graph(3)
    svg = graph.to_svg()
    assert "calls in the same colour may be in flight together" in svg
    group = graph.overlap_groups[0]
    root = list(ET.fromstring(svg))
    fill_of: dict[str, str] = {}
    for element, after in zip(root, root[1:]):
        if element.get("class") == "node" and after.get("font-weight") == "bold":
            fill_of[after.text or ""] = element.get("fill", "")
    labels = [graph.nodes[n].label for n in group]
    assert fill_of[labels[0]] == fill_of[labels[1]] != "#ffffff"
    legend = [e for e in root if e.get("class") == "legend" and e.tag.endswith("rect")]
    assert fill_of[labels[0]] in {e.get("fill") for e in legend}


def test_the_docs_draw_calls_in_flight_together() -> None:
    """The Examples page's last picture: a pipeline whose calls may overlap, in colours explained under it."""
    graph = HOOK.in_flight_together().graph
    assert [len(group) for group in graph.overlap_groups] == [2, 1, 1]
    svg = graph.to_svg()
    assert shortfalls(svg) == []
    root = list(ET.fromstring(svg))
    swatches = {e.get("fill") for e in root if e.get("class") == "legend" and e.tag.endswith("rect")}
    boxes = {e.get("fill") for e in root if e.get("class") == "node" and e.tag.endswith("rect")}
    assert len(swatches) == 3 and swatches <= boxes
