"""SLO policies, run deterministically on an injected clock: at-risk detection, least-slack-first
queues, admission pausing with a bounded queue, and their counters in stats and /metrics."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from serving import metric, run_frontend

import patchkit
from patchkit import Component, make
from patchkit.scheduler.online.averages import RunningAverage
from patchkit.scheduler.online.estimator import accuracy
from patchkit.scheduler.online.slo import SloPolicy
from patchkit.scheduler.online.traces import Trace, Visit
from patchkit.server.metrics import render_metrics
from patchkit.serving.frontend import Frontend


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Step(Component):
    """Takes `ms` of the fake clock per call and records the order it served calls in."""

    def __init__(self, clock: FakeClock, ms: float) -> None:
        self.clock, self.ms, self.order = clock, ms, []

    @make(batch=True, max_batch_size=1)
    def run(self, x: list[str]) -> list[str]:
        self.clock.now += self.ms / 1000 * len(x)
        self.order.extend(x)
        return x


def learned(ms: float) -> RunningAverage:
    """An estimator that has seen one request take `ms` in one call."""
    estimator = RunningAverage()
    estimator.observe(Trace(0, 0.0, 1, [Visit("step.run", "step", 0.0, ms / 1000, 1, 1)], finished=ms / 1000))
    return estimator


def test_a_request_is_at_risk_while_it_can_still_make_its_deadline() -> None:
    clock = FakeClock()
    policy = SloPolicy(learned(10), clock=clock)
    relaxed, tight, free = policy.start(1, 1, 50.0), policy.start(2, 1, 5.0), policy.start(3, 1, None)
    assert policy.check(relaxed) is None and not relaxed.at_risk
    slack = policy.check(tight)
    assert slack == pytest.approx(-0.005) and tight.at_risk
    assert policy.check(free) is None  # no SLO, never at risk
    clock.now += 0.006
    assert policy.check(tight) is None and not tight.at_risk  # past its deadline: lost, no longer favoured
    assert policy.stats()["at_risk_now"] == 0 and policy.stats()["at_risk_total"] == 1
    policy.finish(tight, ok=True)
    policy.finish(relaxed, ok=True)


def test_admission_pauses_while_a_request_is_at_risk_and_its_queue_is_bounded() -> None:
    async def main() -> None:
        clock = FakeClock()
        policy = SloPolicy(learned(10), admission_limit=1, clock=clock)
        await policy.admit(policy.start(1, 1, 1000.0))  # nobody at risk: in at once
        tight = policy.start(2, 1, 5.0)
        policy.check(tight)
        waiting = asyncio.ensure_future(policy.admit(policy.start(3, 1, 1000.0)))
        await asyncio.sleep(0)
        assert not waiting.done() and policy.stats()["admission_waiting"] == 1
        with pytest.raises(patchkit.Overloaded, match="admission is paused"):
            await policy.admit(policy.start(4, 1, 1000.0))
        await asyncio.wait_for(policy.admit(policy.start(5, 1, 5.0)), 1)  # nothing to spare: not held back
        await asyncio.wait_for(policy.admit(), 1)  # no SLO: not held back
        policy.finish(tight, ok=True)
        await asyncio.wait_for(waiting, 1)
        stats = policy.stats()
        assert (stats["admission_paused"], stats["admission_rejected"], stats["admission_waiting"]) == (1, 1, 0)

    asyncio.run(main())


def test_a_request_waits_for_admission_no_longer_than_it_can_spare() -> None:
    async def main() -> None:
        policy = SloPolicy(learned(10), clock=FakeClock())
        policy.check(policy.start(1, 1, 5.0))  # at risk, and never finishes
        await asyncio.wait_for(policy.admit(policy.start(2, 1, 30.0)), 1)  # 30 ms SLO, 10 ms expected: waits 20 ms
        assert policy.stats()["admission_timeouts"] == 1

    asyncio.run(main())


def test_a_request_short_by_more_than_the_queue_waits_ahead_is_beyond_saving() -> None:
    clock = FakeClock()
    estimator = RunningAverage()
    policy = SloPolicy(estimator, clock=clock)
    # One finished request: 10 ms in all, 4 of them waiting in the step's queue.
    finished = Trace(0, 0.0, 1, [Visit("step.run", "step", 0.0, 0.010, 1, 1, waited=0.004)], finished=0.010)
    estimator.observe(finished)
    policy.waits.observe(finished)
    savable, hopeless = policy.start(1, 1, 7.0), policy.start(2, 1, 5.0)  # short by 3 ms and by 5 ms
    assert policy.check(savable) == pytest.approx(-0.003) and savable.at_risk
    assert policy.check(hopeless) is None and not hopeless.at_risk
    assert policy.under_pressure()  # overload all the same, for the autoscaler
    stats = policy.stats()
    assert (stats["at_risk_total"], stats["beyond_saving_total"], stats["lost_now"]) == (1, 1, 1)
    policy.finish(hopeless, ok=True)
    assert policy.stats()["lost_now"] == 0


def test_policies_switched_off_decide_nothing() -> None:
    async def main() -> None:
        policy = SloPolicy(learned(10), prioritize=False, pause_admission=False, clock=FakeClock())
        tight = policy.start(1, 1, 5.0)
        assert policy.check(tight) is None and tight.at_risk  # still detected and counted, not acted on
        await asyncio.wait_for(policy.admit(), 1)

    asyncio.run(main())


def serve_order(prioritize: bool) -> tuple[list[str], dict[str, Any], str]:
    clock = FakeClock()
    step = Step(clock, ms=10)
    query = "warm"
    with patchkit.capture() as pipeline:
        out = step.run(query)  # noqa: F841 - the pipeline's output

    async def body(frontend: Frontend) -> tuple[list[str], dict[str, Any], str]:
        # Four at once, served one by one: a request takes 25 ms on average, of which 15 ms queued.
        await asyncio.gather(*(frontend.query({"query": "warm"}, slo_ms=1000) for _ in range(4)))
        step.order.clear()
        relaxed = [frontend.query({"query": f"r{i}"}, slo_ms=1000) for i in range(4)]
        urgent = frontend.query({"query": "urgent"}, slo_ms=20)  # 5 ms short: jumping the queue saves it
        await asyncio.gather(*relaxed, urgent)
        return list(step.order), frontend.stats()["slo"], render_metrics(frontend.snapshot())

    result: tuple[list[str], dict[str, Any], str] = run_frontend(
        pipeline, body, clock=clock, prioritize=prioritize, max_inflight_batches=1
    )
    return result


def test_calls_of_requests_at_risk_jump_the_queue() -> None:
    order, slo, metrics = serve_order(prioritize=True)
    assert order[0] == "urgent" and order[1:] == ["r0", "r1", "r2", "r3"]
    assert slo["prioritized_calls"] == 1
    assert metric(metrics, "patchkit_slo_decisions_total", decision="prioritized_calls") == 1
    order, slo, _ = serve_order(prioritize=False)
    assert order == ["r0", "r1", "r2", "r3", "urgent"] and slo["prioritized_calls"] == 0


class Shout(Component):
    @make
    def run(self, text: str) -> str:
        return text.upper() + "!"


def test_finished_traces_are_served_for_accuracy_reports() -> None:
    shout = Shout()
    text = "a"
    with patchkit.capture() as pipeline:
        out = shout.run(shout.run(text))  # noqa: F841 - the pipeline's output
    with patchkit.deploy(pipeline, backend="inprocess", slo_ms=60_000) as served:
        answers = [served.query(text=t) for t in "abc"]
        traces = served.traces()
    assert answers == ["A!!", "B!!", "C!!"]
    assert [len(t.visits) for t in traces] == [2, 2, 2]
    assert {v.node for t in traces for v in t.visits} == {"shout.run"}
    assert all(t.finished is not None and t.finished >= t.visits[-1].finished for t in traces)
    assert all(0 <= v.waited <= v.finished - v.started for t in traces for v in t.visits)
    learnt = RunningAverage()
    for trace in traces:
        learnt.observe(trace)
    assert accuracy(learnt, traces)["prefixes"] == 6
