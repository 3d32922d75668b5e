"""The baselines of `benchmarks/throughput.py` compute what the patchkit pipeline computes: the
plain sequential code, the LangGraph graph, and both served by the pre-fork baseline server, on the
same simulated components and inputs (both branches of CRAG, one to four rounds of IRCoT)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import pytest

import patchkit
from benchmarks.baselines.server import running
from benchmarks.baselines.workloads import WORKLOADS, Workload
from tests.serving import ROOT

pytestmark = pytest.mark.slow

pytest.importorskip("langgraph")

QUESTIONS = ["question 0!", "question 1?", "question 3?", "question 6?"]  # "!": fails the grade; 3: four IRCoT rounds
CASES = ["crag-gpu", "ircot-cpu"]


def post(url: str, inputs: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url + "/v1/query", data=json.dumps({"inputs": inputs}).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - a local test server
        return json.loads(response.read())["output"]


def expected(workload: Workload) -> tuple[patchkit.Pipeline, list[Any]]:
    pipeline = workload.capture(workload.build())
    return pipeline, [pipeline(question=q) for q in QUESTIONS]


@pytest.mark.parametrize("name", CASES)
def test_sequential_code_and_graph_match_the_pipeline(name: str) -> None:
    workload = WORKLOADS[name]
    pipeline, outputs = expected(workload)
    components = workload.build()
    graph = workload.graph(components)
    steps = workload.resolved_steps()
    for question, output in zip(QUESTIONS, outputs):
        assert workload.sequential(components, {"question": question}) == output
        assert steps.invoke(graph, {"question": question}) == output
    assert len(set(map(str, outputs))) == len(outputs)  # the inputs take different paths: a wrong branch would show


@pytest.mark.parametrize("name", CASES)
def test_served_baselines_answer_as_patchkit_does(name: str) -> None:
    workload = WORKLOADS[name]
    pipeline, outputs = expected(workload)
    with patchkit.deploy(pipeline, backend="inprocess") as endpoint:
        assert [endpoint.query(question=q) for q in QUESTIONS] == outputs
    for system in ("sequential", "langgraph"):
        with running(system, name, {"cpu": 2, "gpu": 1}, ROOT) as url:
            assert [post(url, {"question": q}) for q in QUESTIONS] == outputs, system


def test_the_server_refuses_a_budget_without_the_units_the_components_need() -> None:
    with pytest.raises(RuntimeError, match="did not start"), running("sequential", "crag-gpu", {"cpu": 2}, ROOT):
        pass
