"""Lookahead prefetch inserted by the front-end: routes found in the captured graph, prefetch sent
as the upstream call starts, switchable, counted in stats() and /metrics (inprocess backend)."""

from __future__ import annotations

from typing import Any

import pytest
from components import Generator
from serving import metric, run_frontend

import patchkit
from patchkit import Component, make
from patchkit.server.metrics import render_metrics
from patchkit.serving.frontend import Frontend
from patchkit.serving.prefetch import find_routes


class PrefetchingRetriever(Component):
    """A keyword retriever that logs, in order, every prefetch and retrieve it serves."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []

    @make(batch=True)
    def retrieve(self, query: list[str]) -> list[list[str]]:
        self.log += [("retrieve", q) for q in query]
        return [[q.upper()] for q in query]

    @make(batch=True)
    def prefetch(self, query: list[str]) -> list[int]:
        self.log += [("prefetch", q) for q in query]
        return [len(q) for q in query]


retriever, llm = PrefetchingRetriever(), Generator()


def rewrite_then_retrieve(question: str) -> Any:
    with patchkit.capture():
        first = retriever.retrieve(question)
        docs = retriever.retrieve(llm.rewrite(question))
        return llm.generate(question, first + docs)


def captured() -> patchkit.Pipeline:
    rewrite_then_retrieve("what is a generator?")
    return patchkit.last_pipeline()


def test_routes_lead_from_the_call_feeding_the_query_to_the_retriever() -> None:
    pipeline = captured()
    routes = find_routes(pipeline.graph)
    assert [(r.source_method, r.target) for r in routes] == [("rewrite", "retriever")]
    nodes = {n.method: n for n in pipeline.graph.nodes.values() if n.component == "llm"}
    assert routes[0].site == nodes["rewrite"].site  # the final generate feeds no query: no route


def _ask(frontend: Frontend) -> Any:
    async def body() -> Any:
        result = await frontend.query({"question": "how do loops work?"})
        return result.output, frontend.stats()["prefetch"], render_metrics(frontend.snapshot())

    return body()


def test_prefetch_goes_out_with_the_generator_input_before_the_search() -> None:
    pipeline = captured()
    served = retriever  # the inprocess backend runs this very object
    served.log.clear()
    output, stats, metrics = run_frontend(pipeline, _ask)
    assert output == pipeline(question="how do loops work?")
    rewritten = llm.rewrite.method.run_local(llm, ("how do loops work?",), {})
    assert served.log.index(("prefetch", "how do loops work?")) < served.log.index(("retrieve", rewritten))
    assert stats["issued"] == 1 and stats["done"] == 1 and stats["bytes_requested"] == len("how do loops work?")
    assert metric(metrics, "patchkit_prefetch_total", outcome="issued") == 1
    assert metric(metrics, "patchkit_prefetch_bytes_total") == 18


def test_prefetch_can_be_switched_off() -> None:
    pipeline = captured()
    retriever.log.clear()
    _, stats, metrics = run_frontend(pipeline, _ask, prefetch=False)
    assert stats["routes"] == 0 and stats["issued"] == 0
    assert not [entry for entry in retriever.log if entry[0] == "prefetch"]
    assert metric(metrics, "patchkit_prefetch_total", outcome="issued") == 0


@pytest.mark.slow
def test_hybrid_retriever_in_a_pipeline_uses_its_prefetched_clusters() -> None:
    from patchkit.components import HybridIVFRetriever

    texts = [f"Topic {t}: note {i} about {word} and {other}." for t, word in enumerate(
        ["loops", "exceptions", "generators", "decorators", "classes", "modules", "files", "strings"])
        for i, other in enumerate(["syntax", "errors", "speed", "style", "tests", "memory", "threads", "types"] * 6)]
    hybrid = HybridIVFRetriever(texts, topk=3, nlist=8, nprobe=4, device="cpu", gpu_budget=0.5, cache_share=0.0)
    question = "how do generators work?"
    with patchkit.capture(output="docs") as pipeline:
        docs = hybrid.retrieve(llm.rewrite(question))  # noqa: F841 - capture(output="docs") returns it
    eager = pipeline(question="what about loops?")

    async def body(frontend: Frontend) -> Any:
        result = await frontend.query({"question": "what about loops?"})
        return result.output, frontend.stats()["prefetch"]

    output, stats = run_frontend(pipeline, body)
    # The device tier changes where clusters are searched, never the answer (scores to float error).
    assert [h.id for h in output] == [h.id for h in eager]
    assert [h.score for h in output] == pytest.approx([h.score for h in eager], abs=1e-5)
    report = hybrid.stats()
    assert stats["done"] >= 1 and report["prefetches"] >= 1 and report["bytes_prefetched"] > 0
    hybrid.close()
