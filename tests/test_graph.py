"""The graph: data and control edges, loops, visits, and its DOT, Mermaid and SVG pictures."""

from __future__ import annotations

import xml.etree.ElementTree as ET

from conftest import load_source
from corpus import CASES

import patchkit


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
