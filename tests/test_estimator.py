"""The completion-time estimators, on traces drawn from a known workload: what they learn per
position, the calls left on a graph with a branch and a loop, and how XGBoost compares."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

import pytest

from patchkit.capture.graph import OUTPUT, Graph, Node
from patchkit.core import CallSite
from patchkit.scheduler.online.averages import RunningAverage
from patchkit.scheduler.online.estimator import accuracy
from patchkit.scheduler.online.traces import Trace, Visit, nodes_remaining, prefixes
from patchkit.scheduler.online.xgb import XGBoostEstimator

# A corrective-RAG pipeline with a branch and a loop: retrieve (n0), grade (n1); three times in ten,
# rewrite the query (n2) and search the web (n3); then generate (n4) and check the answer (n5),
# generating again with probability `again`. Generation and rewriting take time in proportion to
# the query's length, drawn log-uniform, so that the query length tells much about what is left.
LABELS = {"n0": "retriever.retrieve", "n1": "grader.grade", "n2": "rewriter.rewrite", "n3": "web.search",
          "n4": "llm.generate", "n5": "checker.check"}


@dataclass(frozen=True)
class Workload:
    again: float = 0.25  # the loop's chance of another round
    generate_s_per_char: float = 0.0004
    rewrite_s_per_char: float = 0.0001
    shortest: float = 10.0  # query lengths
    longest: float = 1000.0

    def traces(self, rng: random.Random, n: int, first_id: int = 0) -> list[Trace]:
        traces = []
        for i in range(n):
            query = self.shortest * (self.longest / self.shortest) ** rng.random()
            trace = Trace(first_id + i, 10.0 * i, int(query), [])
            call(trace, "n0", rng.uniform(0.015, 0.025), int(query), 2000)
            call(trace, "n1", rng.uniform(0.005, 0.015), 2000, 1)
            if rng.random() < 0.3:
                call(trace, "n2", self.rewrite_s_per_char * query * rng.uniform(0.8, 1.2), int(query), int(query))
                call(trace, "n3", rng.uniform(0.02, 0.06), int(query), 1500)
            while True:
                call(trace, "n4", self.generate_s_per_char * query * rng.uniform(0.8, 1.2), int(query) + 2000, int(query) // 2)
                call(trace, "n5", rng.uniform(0.01, 0.03), int(query) // 2, 1)
                if rng.random() >= self.again:
                    break
            trace.finished = trace.reached
            traces.append(trace)
        return traces

    def expected_remaining(self) -> dict[str | None, float]:
        """The true mean time from reaching each position to the end, where a call is still to come."""
        mean_query = (self.longest - self.shortest) / math.log(self.longest / self.shortest)
        check = 0.02
        loop = (self.generate_s_per_char * mean_query + check) / (1 - self.again)  # the rounds are geometric
        branch = 0.3 * (self.rewrite_s_per_char * mean_query + 0.04)
        return {
            None: 0.02 + 0.01 + branch + loop,
            "n0": 0.01 + branch + loop,
            "n1": branch + loop,
            "n2": 0.04 + loop,
            "n3": loop,
            "n4": check + self.again * loop,
            "n5": loop,  # asked only when another round follows; the rounds do not remember
        }


def call(trace: Trace, node: str, seconds: float, input_length: int, output_length: int) -> None:
    """The request makes its next call as soon as the last returned."""
    started = trace.reached
    trace.visits.append(Visit(node, LABELS[node].split(".")[0], started, started + seconds, input_length, output_length))


def crag_graph() -> Graph:
    """The workload's pipeline graph, as capture would draw it."""
    graph = Graph(["query"])
    for i, (node_id, label) in enumerate(LABELS.items()):
        component, method = label.split(".")
        graph.nodes[node_id] = Node(node_id, component, component.title(), method, CallSite("crag.py", 10 + i, 4, 30))
    for src, dst, kind in [
        ("input:query", "n0", "data"), ("n0", "n1", "data"), ("n1", "n2", "control"), ("n2", "n3", "data"),
        ("n3", "n4", "data"), ("n1", "n4", "control"), ("input:query", "n4", "data"), ("n4", "n5", "data"),
        ("n5", "n4", "control"), ("n4", OUTPUT, "data"),
    ]:
        graph.add_edge(src, dst, kind)  # type: ignore[arg-type]
    return graph


def at(trace: Trace, calls: int) -> Trace:
    """The trace as it stood, in flight, after its first `calls` calls."""
    return replace(trace, visits=trace.visits[:calls], finished=None)


# -- calls left on the graph ----------------------------------------------------------------------------
def test_calls_left_on_a_graph_with_a_branch_and_a_loop() -> None:
    left = nodes_remaining(crag_graph())
    # The loop n4 <-> n5 counts once; the most takes the branch, the fewest goes straight to n4.
    by_id: dict[str | None, tuple[int, int]] = {
        None: (3, 6), "n0": (2, 5), "n1": (1, 4), "n2": (2, 3), "n3": (1, 2), "n4": (0, 1), "n5": (1, 1),
    }
    by_label: dict[str | None, tuple[int, int]] = {label: by_id[node] for node, label in LABELS.items()}
    assert left == by_id | by_label  # the front-end names positions by label


def test_calls_left_from_traces_follow_the_calls_made() -> None:
    traces = Workload().traces(random.Random(3), 200)
    left = nodes_remaining(traces)
    assert left[None] == (4, 6) and left["n1"] == (2, 4) and left["n5"] == (0, 1) and left["n4"] == (1, 1)


def test_calls_left_survive_loops_with_no_way_out_and_calls_on_themselves() -> None:
    graph = Graph(["query"])
    for src, dst in [("input:query", "a"), ("a", "b"), ("b", "a"), ("a", "a"), ("c", "c")]:
        graph.add_edge(src, dst, "data")
    left = nodes_remaining(graph)
    assert left["a"] == (0, 1) and left["b"] == (0, 1)  # a `while True:` loop may end anywhere in it
    assert left["c"] == (0, 0)
    assert left[None] == (1, 2)


# -- the running average --------------------------------------------------------------------------------
def test_running_average_converges_to_the_expected_remaining_time_per_position() -> None:
    workload = Workload()
    estimator = RunningAverage(alpha=0.0005)  # a long memory, for a stationary workload
    for trace in workload.traces(random.Random(1), 8000):
        estimator.observe(trace)
    learned = estimator.expected()
    assert learned.keys() == workload.expected_remaining().keys()
    for position, expected in workload.expected_remaining().items():
        assert learned[position] == pytest.approx(expected, rel=0.1), position


def test_running_average_follows_a_workload_that_changes() -> None:
    before, after = Workload(), Workload(generate_s_per_char=0.0016)
    estimator = RunningAverage(alpha=0.05)
    for trace in before.traces(random.Random(2), 1000) + after.traces(random.Random(3), 400):
        estimator.observe(trace)
    learned, old, new = estimator.expected(), before.expected_remaining(), after.expected_remaining()
    for position in (None, "n1", "n5"):
        assert abs(learned[position] - new[position]) < 0.25 * new[position] < abs(learned[position] - old[position])


def test_running_average_subtracts_the_time_spent_and_never_goes_below_zero() -> None:
    estimator = RunningAverage()
    trace = next(t for t in Workload().traces(random.Random(4), 10) if len(t.visits) == 4)  # n0 n1 n4 n5
    in_flight = at(trace, 2)
    assert estimator.remaining_s(in_flight, in_flight.reached) == 0.0  # it knows nothing yet
    estimator.observe(trace)
    total = trace.finished - trace.arrived  # type: ignore[operator]
    assert estimator.remaining_s(at(trace, 0), trace.arrived + 0.01) == pytest.approx(total - 0.01)
    # n3 was never seen: the mean total latency, less the time since arrival
    unseen = replace(in_flight, visits=[*in_flight.visits, replace(in_flight.visits[-1], node="n3")])
    assert estimator.remaining_s(unseen, in_flight.reached) == pytest.approx(total - (in_flight.reached - trace.arrived))
    assert estimator.remaining_s(in_flight, in_flight.reached + 60.0) == 0.0
    assert estimator.remaining_s(unseen, in_flight.reached + 60.0) == 0.0


def test_with_the_graph_an_unseen_position_borrows_from_those_before_the_same_call() -> None:
    workload = Workload()
    traces = workload.traces(random.Random(5), 1500)
    straight = [t for t in traces if "n3" not in {v.node for v in t.visits}]
    blind, informed = RunningAverage(alpha=0.01), RunningAverage(alpha=0.01, graph=crag_graph())
    for trace in straight:
        blind.observe(trace)
        informed.observe(trace)
    learned = informed.expected()
    assert "n3" not in learned
    # A request that took the branch, after the web search (n3): generation comes next, as after
    # grading (n1) or checking (n5), so it expects what they expect. Without the graph, the mean
    # latency of requests that did not take the branch, less its elapsed time, falls short.
    searched = at(next(t for t in traces if t not in straight), 4)
    assert searched.position == "n3"
    now = searched.reached
    assert informed.remaining_s(searched, now) == pytest.approx((learned["n1"] + learned["n5"]) / 2)
    truth = workload.expected_remaining()["n3"]
    assert abs(informed.remaining_s(searched, now) - truth) < 0.5 * abs(blind.remaining_s(searched, now) - truth)


def test_estimators_learn_from_finished_traces_only() -> None:
    trace = at(Workload().traces(random.Random(6), 1)[0], 3)
    with pytest.raises(ValueError, match="request 0 is still in flight"):
        RunningAverage().observe(trace)
    with pytest.raises(ValueError, match="still in flight"):
        accuracy(RunningAverage(), [trace])
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        RunningAverage(alpha=0)


# -- XGBoost ------------------------------------------------------------------------------------------------
def test_xgboost_sees_the_query_length_the_running_average_cannot() -> None:
    pytest.importorskip("xgboost")
    rng = random.Random(7)
    workload = Workload()
    train, held_out = workload.traces(rng, 500), workload.traces(rng, 300, first_id=500)
    average = RunningAverage()
    for trace in train:
        average.observe(trace)
    xgb = XGBoostEstimator()
    xgb.fit(train)
    xgb_with_graph = XGBoostEstimator(crag_graph())
    xgb_with_graph.fit(train)
    scores = {e: accuracy(e, held_out) for e in (average, xgb, xgb_with_graph)}
    assert scores[average]["prefixes"] == sum(len(t.visits) for t in held_out)
    for score in scores.values():
        assert 0 < score["mae_s"] < 0.2 and 0 < score["mape"] < 5 and abs(score["bias_s"]) < score["mae_s"]
    assert scores[xgb]["mae_s"] <= 0.8 * scores[average]["mae_s"]
    assert scores[xgb_with_graph]["mae_s"] <= 0.8 * scores[average]["mae_s"]
    for trace in held_out[:20]:
        for k, reached in prefixes(trace):
            for waited in (0.0, 0.5, 30.0):
                assert xgb.remaining_s(at(trace, k), reached + waited) >= 0.0


def test_untrained_xgboost_delegates_to_the_running_average_then_retrains() -> None:
    pytest.importorskip("xgboost")
    traces = Workload().traces(random.Random(8), 60)
    xgb = XGBoostEstimator(min_traces=40, retrain_every=10, rounds=10, background=False)
    average = RunningAverage()
    probe = at(traces[0], 2)
    for trace in traces[:39]:
        xgb.observe(trace)
        average.observe(trace)
    assert not xgb.trained
    for now in (probe.reached, probe.reached + 0.05):
        assert xgb.remaining_s(probe, now) == average.remaining_s(probe, now)
    xgb.observe(traces[39])
    assert xgb.trained
    booster = xgb._model
    for trace in traces[40:49]:
        xgb.observe(trace)
    assert xgb._model is booster
    xgb.observe(traces[49])
    assert xgb._model is not booster  # retrained on the 50 it keeps
    assert len(xgb.traces) == 50


def test_xgboost_trains_on_a_thread_of_its_own_by_default() -> None:
    pytest.importorskip("xgboost")
    traces = Workload().traces(random.Random(9), 40)
    xgb = XGBoostEstimator(min_traces=40, rounds=10)
    for trace in traces:
        xgb.observe(trace)  # the 40th starts training and returns without waiting for it
    assert xgb._training is not None
    xgb._training.join(30)
    assert xgb.trained


def test_xgboost_settings_are_checked_when_given() -> None:
    pytest.importorskip("xgboost")
    with pytest.raises(ValueError, match=r"max_traces \(30\) must be >= min_traces \(50\)"):
        XGBoostEstimator(max_traces=30)
    with pytest.raises(ValueError, match=r"retrain_every \(0\)"):
        XGBoostEstimator(retrain_every=0)
