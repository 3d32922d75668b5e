"""`patchkit.plan` of several pipelines served by one deployment: a component they share is one component,
profiled once with the calls of every pipeline that calls it, its visits weighted by each pipeline's share
of the requests (`weights=`, default equal); the plan's throughput is requests/s of that mix.

Two pipelines share a retriever (crag retrieves twice a request, hyde once) and each has an `llm` of its
own on (virtual) GPUs, crag's twice as slow a call as hyde's. Four GPUs: the weights decide which one
gets three.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

import patchkit
from patchkit import Component, make
from patchkit.components.testing import Simulated
from patchkit.scheduler.offline.plan import Plan
from patchkit.scheduler.offline.workload import interleave

POOL = {"cpu": 1, "gpu": 4}  # one core: every CPU component is profiled at 1 thread only, once
CALIBRATION = {"crag": [{"question": "a"}], "hyde": [{"question": "b"}]}


pytestmark = pytest.mark.usefixtures("profile_cache")  # autouse: profiles cached under each test's directory


class Noted(Component):
    """A retriever that notes each query it is given in `log`, with the process it ran in."""

    def __init__(self, log: str) -> None:
        self.log = log

    @make(batch=True, max_batch_size=8, read_only=True)
    def run(self, query: list[str]) -> list[str]:
        with open(self.log, "a") as log:
            log.writelines(f"{os.getpid()} {q}\n" for q in query)
        return query


def crag_of(retriever: Component, llm: Simulated) -> patchkit.Pipeline:
    question = "q"
    with patchkit.capture(run=False) as pipeline:
        docs = retriever.run(question)
        docs = retriever.run(docs)  # a second retrieval: 2 visits a request
        answer = llm.run(docs)  # noqa: F841 - the pipeline's output
    return pipeline


def hyde_of(retriever: Component, llm: Simulated) -> patchkit.Pipeline:
    question = "q"
    with patchkit.capture(run=False) as pipeline:
        docs = retriever.run(question)
        answer = llm.run(docs)  # noqa: F841 - the pipeline's output
    return pipeline


def two_pipelines(log: Path) -> dict[str, patchkit.Pipeline]:
    """crag and hyde sharing one retriever; each its own `llm`: 4 ms a call in crag, 2 ms in hyde."""
    retriever = Noted(str(log))
    return {
        "crag": crag_of(retriever, Simulated(lambda b: 4.0 * b, resource="gpu", max_batch=8)),
        "hyde": hyde_of(retriever, Simulated(lambda b: 2.0 * b, resource="gpu", max_batch=8)),
    }


def profiled_queries(log: Path) -> set[str]:
    """The queries the retriever was given outside this process: by the profiler's worker."""
    here = str(os.getpid())
    return {query for pid, query in (line.split() for line in log.read_text().splitlines()) if pid != here}


@pytest.mark.slow
def test_a_shared_component_is_planned_once_and_profiled_once_with_both_pipelines_calls(
    tmp_path: Path, workers_started: list[str]
) -> None:
    log = tmp_path / "retriever.log"
    made = patchkit.plan(two_pipelines(log), resources=POOL, calibration=CALIBRATION, progress=False)
    assert sorted(made.components) == ["hyde/llm", "llm", "retriever"]  # hyde's llm is another object
    assert sorted(workers_started) == ["profile-hyde/llm", "profile-llm", "profile-retriever"]
    assert profiled_queries(log) == {"a", "b"}  # crag's calibration call and hyde's, in one worker
    visits = {name: c.visits for name, c in made.components.items()}
    assert visits == {"retriever": pytest.approx(1.5), "llm": pytest.approx(0.5), "hyde/llm": pytest.approx(0.5)}
    assert made.weights == {"crag": 0.5, "hyde": 0.5}
    assert "planned for this mix of requests: crag 50%, hyde 50%" in made.table()
    assert Plan.from_dict(made.to_dict()) == made


@pytest.mark.slow
def test_weights_move_the_units_to_the_busier_pipelines_component(tmp_path: Path, workers_started: list[str]) -> None:
    pipelines = two_pipelines(tmp_path / "retriever.log")
    crag_mostly = patchkit.plan(pipelines, weights={"crag": 9, "hyde": 1}, resources=POOL, calibration=CALIBRATION,
                                progress=False)
    workers_started.clear()
    hyde_mostly = patchkit.plan(pipelines, weights={"crag": 0.1, "hyde": 0.9}, resources=POOL, calibration=CALIBRATION,
                                progress=False)
    assert workers_started == []  # the same calls: every profile read from the cache
    assert crag_mostly.weights == pytest.approx({"crag": 0.9, "hyde": 0.1})
    assert hyde_mostly.weights == pytest.approx({"crag": 0.1, "hyde": 0.9})
    # visits of the mix: the shared retriever 0.9 * 2 + 0.1 * 1, each llm its pipeline's share
    assert crag_mostly.components["retriever"].visits == pytest.approx(1.9)
    assert hyde_mostly.components["retriever"].visits == pytest.approx(1.1)
    assert (crag_mostly.components["llm"].visits, crag_mostly.components["hyde/llm"].visits) == pytest.approx((0.9, 0.1))
    # crag's llm serves 250 calls/s a replica, hyde's 500: 9 of 10 requests to crag want 3 of the 4 GPUs for
    # crag's llm (833 requests/s, where 2 and 2 give 555); 9 of 10 to hyde want 3 for hyde's (1667, not 1111)
    replicas = {name: (crag_mostly.components[name].replicas, hyde_mostly.components[name].replicas)
                for name in ("llm", "hyde/llm")}
    assert replicas == {"llm": (3, 1), "hyde/llm": (1, 3)}
    assert (crag_mostly.bottleneck, hyde_mostly.bottleneck) == ("llm", "hyde/llm")
    for made in (crag_mostly, hyde_mostly):  # requests/s of the mix: what the bottleneck's calls/s allow
        slowest = made.components[made.bottleneck]
        assert made.throughput == pytest.approx(slowest.throughput / slowest.visits)
    assert hyde_mostly.throughput > crag_mostly.throughput  # hyde's requests cost half the GPU time

    only_crag = patchkit.plan(pipelines, weights={"crag": 1, "hyde": 0}, resources=POOL, calibration=CALIBRATION,
                              progress=False)
    idle = only_crag.components["hyde/llm"]  # a pipeline with no share: its own components get one replica
    assert (idle.visits, idle.replicas) == (0.0, 1) and only_crag.components["llm"].replicas == 3
    assert only_crag.components["retriever"].visits == pytest.approx(2.0)


@pytest.mark.slow
def test_one_pipeline_plans_as_the_same_pipeline_given_by_name(tmp_path: Path, workers_started: list[str]) -> None:
    crag = two_pipelines(tmp_path / "retriever.log")["crag"]
    alone = patchkit.plan(crag, resources=POOL, calibration=CALIBRATION["crag"], progress=False)
    assert sorted(workers_started) == ["profile-llm", "profile-retriever"]
    assert list(alone.components) == list(crag.components) and sorted(alone.components) == ["llm", "retriever"]
    assert alone.weights == {} and "mix" not in alone.table()
    assert (alone.components["retriever"].visits, alone.components["llm"].visits) == (2.0, 1.0)
    assert alone.components["llm"].replicas == 4 and alone.bottleneck == "llm"  # the only GPU component: every GPU
    named = patchkit.plan({"crag": crag}, resources=POOL, calibration={"crag": CALIBRATION["crag"]}, progress=False)
    assert named.weights == {"crag": 1.0}
    assert {**named.to_dict(), "weights": {}} == alone.to_dict()


def test_interleave_takes_each_pipelines_calls_in_turn() -> None:
    assert interleave([[1, 2, 3], [10], [], [20, 30]]) == [1, 10, 20, 2, 30, 3]
    assert interleave([[1, 2]]) == [1, 2] and interleave([]) == []


@pytest.fixture
def pipelines(tmp_path: Path) -> dict[str, patchkit.Pipeline]:
    return two_pipelines(tmp_path / "retriever.log")


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ({"crag": 1}, r"weights have no weight for 'hyde': give one per pipeline \('crag', 'hyde'\)"),
        ({"crag": 1, "hyde": 1, "rag": 1}, r"weights name 'rag', not a pipeline"),
        ({"crag": -1, "hyde": 2}, r"the weight of 'crag' must be a finite number >= 0 .*; got -1"),
        ({"crag": math.nan, "hyde": 1}, r"the weight of 'crag' must be a finite number >= 0 .*; got nan"),
        ({"crag": True, "hyde": 1}, r"the weight of 'crag' must be a finite number >= 0 .*; got True"),
        ({"crag": "3", "hyde": 1}, r"the weight of 'crag' must be a finite number >= 0 .*; got '3'"),
        ({"crag": 0, "hyde": 0.0}, r"weights are all 0: .* weights=\{'crag': 1, 'hyde': 1\}"),
        ([0.5, 0.5], r"weights must map each pipeline's name to its share of the requests"),
    ],
)
def test_weights_that_are_not_a_share_per_pipeline_are_a_config_error(
    pipelines: dict[str, patchkit.Pipeline], weights: object, message: str
) -> None:
    with pytest.raises(patchkit.ConfigError, match=message):
        patchkit.plan(pipelines, weights=weights, resources=POOL, progress=False)  # type: ignore[arg-type]


def test_what_plan_takes_is_checked_before_anything_runs(pipelines: dict[str, patchkit.Pipeline]) -> None:
    with pytest.raises(patchkit.ConfigError, match=r"weights= shares the requests among several pipelines"):
        patchkit.plan(pipelines["crag"], weights={"crag": 1}, progress=False)
    with pytest.raises(patchkit.ConfigError, match="no pipeline"):
        patchkit.plan({}, progress=False)
    with pytest.raises(patchkit.ConfigError, match="takes captured pipelines .* hyde is a str"):
        patchkit.plan({"crag": pipelines["crag"], "hyde": "hyde.py"}, progress=False)  # type: ignore[dict-item]
    with pytest.raises(patchkit.ConfigError, match="without '/'; got 'a/b'"):
        patchkit.plan({"a/b": pipelines["crag"]}, progress=False)
    with pytest.raises(patchkit.InputError, match=r"calibration takes their inputs by name, such as \{'crag': "):
        patchkit.plan(pipelines, calibration=[{"question": "a"}], progress=False)
    with pytest.raises(patchkit.InputError, match="calibration names 'rag', not a pipeline"):
        patchkit.plan(pipelines, calibration={"rag": [{"question": "a"}]}, progress=False)
    with pytest.raises(patchkit.PlanError, match=r"pipeline 'hyde' has never run.* calibration=\{'hyde': \[\{\.\.\.\}"):
        patchkit.plan(pipelines, calibration={"crag": [{"question": "a"}]}, resources=POOL, progress=False)
