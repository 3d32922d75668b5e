"""The graph: data and control edges, loops, visits, and its DOT, Mermaid and SVG pictures."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

from conftest import load_source
from corpus import CASES

import patchkit
from patchkit.capture.graph import Graph


def _pipeline(name: str) -> patchkit.Pipeline:
    case = next(c for c in CASES if c.name == name)
    ns = load_source(case.source, f"<graph {name}>")
    ns["run"](**case.inputs[0])
    return patchkit.last_pipeline()


def _edges(pipeline: patchkit.Pipeline) -> set[tuple[str, str, str]]:
    label = {n.id: n.label for n in pipeline.graph.nodes.values()}
    return {(label.get(e.src, e.src), label.get(e.dst, e.dst), e.kind) for e in pipeline.graph.edges}


def test_crag_edges_and_guards() -> None:
    pipeline = _pipeline("crag_figure9")
    edges = _edges(pipeline)
    assert ("input:query", "retriever.retrieve", "data") in edges
    assert ("retriever.retrieve", "grader.grade", "data") in edges
    assert ("grader.grade", "llm.generate", "control") in edges
    assert ("llm.generate", "output", "data") in edges
    guarded = [n for n in pipeline.graph.nodes.values() if n.guards]
    assert guarded and all(g.kind == "if" for n in guarded for g in n.guards)


def test_helper_calls_are_the_helpers_components() -> None:
    edges = _edges(_pipeline("helper_calls_component"))
    assert ("llm.generate", "retriever.retrieve", "data") in edges
    assert ("retriever.retrieve", "llm2.generate", "data") in edges


def test_loops_name_the_calls_they_repeat_and_visits_add_up() -> None:
    pipeline = _pipeline("ircot_loop")
    graph = pipeline.graph
    looped = {n.label for n in graph.nodes.values() if n.loops}
    assert looped == {"retriever.retrieve", "llm.generate", "grader.score"}
    assert {loop.kind for loop in graph.loops.values()} == {"for"}
    assert ("llm.generate", "retriever.retrieve", "data") in _edges(pipeline)  # across iterations
    assert sum(n.visits for n in graph.nodes.values()) == len(pipeline.recorded)
    per_run = graph.visits_per_run()
    assert max(per_run.values()) > 1


def test_pictures_render_acyclic_and_looping_graphs() -> None:
    for name in ("crag_figure9", "ircot_loop"):
        graph = _pipeline(name).graph
        dot, mermaid, svg = graph.to_dot(), graph.to_mermaid(), graph._repr_svg_()
        assert dot.startswith("digraph pipeline {") and "->" in dot
        assert mermaid.startswith("flowchart TD") and "-->" in mermaid
        root = ET.fromstring(svg)
        assert root.tag.endswith("svg")
        for node in graph.nodes.values():
            assert node.label in dot and node.label in mermaid and node.label in svg
    assert "cluster_" in graph.to_dot() and "subgraph" in graph.to_mermaid()
    assert set(graph._repr_mimebundle_()) == {"image/svg+xml", "text/plain"}


def _grouped(name: str) -> Graph:
    """A captured graph whose calls n0 and n1 may be in flight together, and n2 several times at once."""
    graph = _pipeline(name).graph
    graph.overlap_groups = [("n0", "n1"), ("n2",)]
    return graph


def test_graph_json_carries_overlap_groups() -> None:
    data = json.loads(json.dumps(_grouped("crag_figure9").to_json()))
    assert data["overlap_groups"] == [["n0", "n1"], ["n2"]]
    groups = {n["id"]: n["overlap_group"] for n in data["nodes"]}
    assert groups == {"n0": 0, "n1": 0, "n2": 1, "n3": None, "n4": None, "n5": None}
    assert _pipeline("crag_figure9").graph.to_json()["overlap_groups"] == []


_MERMAID_STATEMENT = re.compile(
    r'\s+\w+(\["[^"]*"\]|\(\["[^"]*"\]\))'  # a node
    r'|  subgraph \w+\["[^"]*"\]|  end'
    r"|  \w+ (-->|-\.->|-\.-)(\|[^|]+\|)? \w+"  # a link, with its label
    r"|  classDef \w+ [\w:#,-]+|  class [\w,]+ \w+"
)


def _dot_fills(dot: str) -> dict[str, str | None]:
    """The fill colour of each call box in DOT text (None: not filled)."""
    boxes = re.findall(r'^ +"(n\d+)" \[shape=box, (.*)\];$', dot, re.M)
    return {node_id: (m.group(1) if (m := re.search(r'fillcolor="([^"]+)"', attrs)) else None) for node_id, attrs in boxes}


def test_mermaid_and_dot_mark_overlap_groups_and_keep_loops() -> None:
    for name in ("crag_figure9", "ircot_loop"):
        graph = _grouped(name)
        mermaid = graph.to_mermaid().splitlines()
        assert mermaid[0] == "flowchart TD" and all(_MERMAID_STATEMENT.fullmatch(line) for line in mermaid[1:])
        classes = [line.split()[1:] for line in mermaid if line.startswith("  class ")]
        assert classes == [["n0,n1", "overlap0"], ["n2", "overlap1"]]
        assert [line for line in mermaid if "overlap" in line and "class" not in line] == ["  n0 -.-|overlap| n1"]
        assert [line.split("[")[0].strip() for line in mermaid if "several in flight" in line] == ["n2"]

        dot = graph.to_dot()
        fills = _dot_fills(dot)
        assert None not in (fills["n0"], fills["n2"]) and fills["n0"] == fills["n1"] != fills["n2"]
        assert all(fill is None for node_id, fill in fills.items() if node_id not in ("n0", "n1", "n2"))
        overlap_edges = [line.strip() for line in dot.splitlines() if 'label="overlap"' in line]
        assert overlap_edges == ['"n0" -> "n1" [style=dotted, dir=none, constraint=false, label="overlap"];']
    start = next(i for i, line in enumerate(mermaid) if line.startswith("  subgraph"))  # ircot_loop's loop
    assert [line.split("[")[0].strip() for line in mermaid[start + 1 : mermaid.index("  end")]] == ["n0", "n1", "n2"]
    assert 'subgraph "cluster_' in dot


def _svg_boxes(svg: str) -> dict[tuple[str, int], list[str]]:
    """The fills of each call's box(es) in an SVG picture (two for a stacked box), by title and line."""
    boxes: dict[tuple[str, int], list[str]] = {}
    children = list(ET.fromstring(svg))
    rects: list[str] = []
    for element, after in zip(children, children[1:]):
        tag = element.tag.rsplit("}", 1)[-1]
        if tag == "rect":
            rects.append(element.get("fill", ""))
            continue
        if tag == "text" and element.get("font-weight") == "bold" and rects:
            line = re.search(r"line (\d+)", after.text or "")
            assert line is not None
            boxes[(element.text or "", int(line.group(1)))] = rects
        rects = []
    return boxes


def test_svg_colours_overlap_groups_and_explains_them() -> None:
    for name in ("crag_figure9", "ircot_loop"):
        graph = _grouped(name)
        svg = graph.to_svg()
        boxes = _svg_boxes(svg)
        fills = {n.id: boxes[(n.label, n.site.lineno)] for n in graph.nodes.values()}
        assert fills["n0"] == fills["n1"] != ["#ffffff"] and len(fills["n0"]) == 1
        assert fills["n2"] == [fills["n2"][0]] * 2 and fills["n2"][0] not in ("#ffffff", fills["n0"][0])
        assert all(fill == ["#ffffff"] for node_id, fill in fills.items() if node_id not in ("n0", "n1", "n2"))
        assert "calls in the same colour may be in flight together" in svg and "stacked box" in svg
        plain = _pipeline(name).graph
        assert "in flight" not in plain.to_svg() + plain.to_dot() + plain.to_mermaid()


def test_components_passed_to_a_helper_are_its_calls_before_any_run() -> None:
    ns = load_source(
        '''
def answer(q, search, writer, words=8):
    docs = search.retrieve(q)
    return writer.generate(q, docs, max_words=words)
def run(query):
    with patchkit.capture(run=False):
        return answer(query, retriever, llm)
''',
        "<graph helper arguments>",
    )
    ns["run"]("What is a generator?")
    edges = _edges(patchkit.last_pipeline())
    assert {("input:query", "retriever.retrieve", "data"), ("retriever.retrieve", "llm.generate", "data")} <= edges
    assert ("llm.generate", "output", "data") in edges


def test_components_passed_by_keyword_to_a_helper_are_its_calls() -> None:
    ns = load_source(
        '''
def answer(q, search=None, writer=None):
    return writer.generate(q, search.retrieve(q))
def run(query):
    with patchkit.capture(run=False):
        return answer(query, writer=llm, search=retriever)
''',
        "<graph helper keywords>",
    )
    ns["run"]("What is a generator?")
    assert ("retriever.retrieve", "llm.generate", "data") in _edges(patchkit.last_pipeline())


def _fields(source: str) -> dict[str, set[str]]:
    ns = load_source(source, "<graph output fields>")
    ns["run"]("What is a generator?")
    graph = patchkit.last_pipeline().graph
    return {field: {graph.nodes[node].label for node in nodes} for field, nodes in graph.output_fields.items()}


def test_a_dict_outputs_fields_are_known_by_the_calls_that_make_them() -> None:
    displayed = _fields('''
def run(query):
    with patchkit.capture(run=False):
        draft = llm.generate(query)
        answer = llm2.generate(draft)
        return {"answer": answer, "draft": draft, "query": query}
''')
    assert displayed == {"answer": {"llm2.generate"}, "draft": {"llm.generate"}}
    branched = _fields('''
def run(query):
    with patchkit.capture(run=False):
        if query:
            answer = llm.generate(query)
        else:
            answer = llm2.generate(query)
        out = {"answer": answer, "upper": llm.generate(query).upper()}
        return out
''')
    assert branched == {"answer": {"llm.generate", "llm2.generate"}}  # a result changed on its way is no field's
    filled = _fields('''
def run(query):
    with patchkit.capture(run=False):
        out = {}
        out["answer"] = llm.generate(query)
        return out
''')
    assert filled == {}  # known by no display: no call makes a field (the chat API then streams none)
    helped = _fields('''
def both(query):
    return {"answer": llm.generate(query), "followup": llm2.generate(query)}
def run(query):
    with patchkit.capture(run=False):
        return both(query)
''')
    assert helped == {"answer": {"llm.generate"}, "followup": {"llm2.generate"}}  # a helper's display, as the body's
