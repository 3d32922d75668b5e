"""Autoscaling, run deterministically on an injected clock with `Autoscaler.step` called directly
(inprocess backend): one replica more for the bottleneck once requests stay at risk and a unit is
free, none past max_replicas or without one, idle replicas removed after the cool-down down to
min_replicas, no failed call while replicas come and go. On real worker processes (slow): a
replica retired with a batch in flight finishes it first, and the running loop scales a
deployment up and back down with every query answered."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from serving import metric, run_frontend
from test_slo import FakeClock, learned

import patchkit
from patchkit.components.testing import Simulated
from patchkit.config import DeploymentConfig
from patchkit.config.backends import make_backend
from patchkit.orchestrator.backend import ReplicaSpec
from patchkit.orchestrator.resources import SHARES_PER_CORE, ReplicaResources, one_more
from patchkit.scheduler.offline.plan import ComponentPlan, Plan
from patchkit.scheduler.online.slo import RequestState
from patchkit.server.metrics import render_metrics
from patchkit.serving.frontend import Frontend, RequestResult

fast, slow, sim = Simulated(0.0), Simulated(0.0), Simulated(50.0, max_batch=1)
HOLD_MS = 60_000.0  # calls wait this long for a full batch: on the fake clock, until a test lets them go


def routed(query: str = "f") -> patchkit.Pipeline:
    """Queries starting with "f" go to `fast`, the others to `slow`."""
    with patchkit.capture() as pipeline:
        if query.startswith("f"):
            out = fast.run(query)  # noqa: F841 - the pipeline's output
        else:
            out = slow.run(query)  # noqa: F841
    return pipeline


def simulated(query: str = "q") -> patchkit.Pipeline:
    with patchkit.capture() as pipeline:
        out = sim.run(query)  # noqa: F841 - the pipeline's output
    return pipeline


def planned(fast_per_s: float, slow_per_s: float, cpus: int) -> Plan:
    components = {"fast": ComponentPlan("cpu", 1, 64, throughput=fast_per_s),
                  "slow": ComponentPlan("cpu", 1, 64, throughput=slow_per_s)}
    return Plan(components, throughput=slow_per_s, bottleneck="slow", capacity={"cpu": cpus})


def serve(clock: FakeClock, body: Callable[[Frontend], Awaitable[Any]], **options: Any) -> Any:
    """Run `body(frontend)` on an inprocess Frontend with the fake clock and no autoscaling loop."""
    return run_frontend(routed(), body, clock=clock, autoscale=False, **options)


async def hold(frontend: Frontend, fast_calls: int, slow_calls: int) -> list[asyncio.Future[RequestResult]]:
    """Queries whose calls wait in their queues (for HOLD_MS of the fake clock) until `release`."""
    queries = [f"f{i}" for i in range(fast_calls)] + [f"s{i}" for i in range(slow_calls)]
    held = [asyncio.ensure_future(frontend.query({"query": q})) for q in queries]
    for _ in range(1_000):  # loop turns, not time: each query runs on until its call waits in its queue
        if sum(len(q) for q in frontend.deployment.queues.values()) == len(queries):
            break
        await asyncio.sleep(0)
    assert sum(len(q) for q in frontend.deployment.queues.values()) == len(queries)
    return held


async def release(frontend: Frontend, clock: FakeClock, held: list[asyncio.Future[RequestResult]]) -> list[Any]:
    clock.now += HOLD_MS / 1000
    for replica_set in frontend.deployment.sets.values():
        replica_set.kick()
    return [r.output for r in await asyncio.gather(*held)]


def put_at_risk(frontend: Frontend) -> RequestState:
    """A request the estimator expects to take 10 ms more, with 5 ms left: at risk until it finishes."""
    frontend.policy.estimator = learned(10)
    state = frontend.policy.start(0, "x", 5.0)
    frontend.policy.check(state)
    assert frontend.policy.at_risk == {state}
    return state


def replicas(frontend: Frontend) -> dict[str, int]:
    return {name: len(s.replicas) for name, s in frontend.deployment.sets.items()}


# -- scaling up ---------------------------------------------------------------------------------------
def test_the_bottleneck_by_the_plan_gets_a_replica_once_requests_stay_at_risk() -> None:
    clock = FakeClock()

    async def body(frontend: Frontend) -> None:
        held = await hold(frontend, fast_calls=20, slow_calls=10)  # queues drain in 20/100 s and in 10/10 s
        state, scaler, t0 = put_at_risk(frontend), frontend.deployment.autoscaler, clock.now
        assert await scaler.step(t0) == []
        assert await scaler.step(t0 + 1.9) == []  # not at risk for scale_up_after_s yet
        [up] = await scaler.step(t0 + 2.0)
        assert (up.kind, up.component, up.replicas) == ("scale_up", "slow", 2)
        assert replicas(frontend) == {"fast": 1, "slow": 2}
        assert await scaler.step(t0 + 3.9) == []  # the new replica gets scale_up_after_s to help
        [up] = await scaler.step(t0 + 4.0)  # 10 calls / (2 replicas x 10/s) is still the longest
        assert (up.component, up.replicas) == ("slow", 3)
        assert await scaler.step(t0 + 6.0) == []  # 4 of 4 cores taken: no unit is free
        assert replicas(frontend) == {"fast": 1, "slow": 3}
        assert await release(frontend, clock, held) == [f"f{i}" for i in range(20)] + [f"s{i}" for i in range(10)]
        frontend.policy.finish(state, ok=False)
        stats, metrics = frontend.stats(), render_metrics(frontend.snapshot())
        assert [r["id"] for r in stats["components"]["slow"]["replicas"]] == ["slow#0", "slow#1", "slow#2"]
        assert stats["slo"]["scale_ups"] == 2 and stats["requests"]["ok"] == 30
        assert metric(metrics, "patchkit_slo_decisions_total", decision="scale_ups") == 2
        assert metric(metrics, "patchkit_replicas", component="slow") == 3

    serve(clock, body, plan=planned(100.0, 10.0, cpus=4), batch_wait_ms=HOLD_MS, pause_admission=False)


def test_the_bottleneck_by_measured_throughput_gets_the_replica() -> None:
    clock = FakeClock()

    async def body(frontend: Frontend) -> None:
        await release(frontend, clock, await hold(frontend, fast_calls=40, slow_calls=4))  # 4 calls/s and 0.4 calls/s
        held = await hold(frontend, fast_calls=20, slow_calls=10)  # more calls wait for fast, but slow drains slower
        frontend.deployment.autoscaler.policy.capacity = {"cpu": 8}
        state, t0 = put_at_risk(frontend), clock.now
        await frontend.deployment.autoscaler.step(t0)
        [up] = await frontend.deployment.autoscaler.step(t0 + 2.0)
        assert up.component == "slow" and "drain in 25.00 s" in up.reason
        await release(frontend, clock, held)
        frontend.policy.finish(state, ok=False)

    serve(clock, body, batch_wait_ms=HOLD_MS, pause_admission=False)


@pytest.mark.parametrize("limit", [{"max_replicas": {"slow": 1}}, {"plan": planned(100.0, 10.0, cpus=2)}],
                         ids=["at max_replicas", "no free unit"])
def test_no_replica_is_added_at_max_replicas_or_without_a_free_unit(limit: dict[str, Any]) -> None:
    clock = FakeClock()
    options = {"plan": planned(100.0, 10.0, cpus=4), **limit}

    async def body(frontend: Frontend) -> None:
        held = await hold(frontend, fast_calls=20, slow_calls=10)
        state, t0 = put_at_risk(frontend), clock.now
        for later in (0.0, 2.0, 4.0, 10.0):  # nor to fast, which is not the bottleneck
            assert await frontend.deployment.autoscaler.step(t0 + later) == []
        assert replicas(frontend) == {"fast": 1, "slow": 1} and frontend.policy.counts["scale_ups"] == 0
        await release(frontend, clock, held)
        frontend.policy.finish(state, ok=False)

    serve(clock, body, batch_wait_ms=HOLD_MS, pause_admission=False, **options)


# -- scaling down -------------------------------------------------------------------------------------
def test_idle_replicas_are_removed_after_the_cool_down_down_to_min_replicas() -> None:
    clock = FakeClock()

    async def body(frontend: Frontend) -> None:
        await release(frontend, clock, await hold(frontend, fast_calls=6, slow_calls=6))
        scaler, t0 = frontend.deployment.autoscaler, clock.now  # both last served at t0
        assert await scaler.step(t0 + 29.0) == []
        [down] = await scaler.step(t0 + 30.0)
        assert (down.kind, down.component, down.replicas) == ("scale_down", "fast", 2)
        [down] = await scaler.step(t0 + 30.0)  # one per step
        assert (down.component, down.replicas) == ("fast", 1)
        assert await scaler.step(t0 + 100.0) == []  # fast is at its min_replicas, slow as deployed
        assert [r.id for r in frontend.deployment.sets["fast"].replicas] == ["fast#0"]  # the newest went first
        assert [r.id for r in frontend.deployment.supervisor.replicas("fast")] == ["fast#0"]  # stopped, not restarted
        assert frontend.deployment.supervisor.restarts == 0 and frontend.stats()["slo"]["scale_downs"] == 2
        assert metric(render_metrics(frontend.snapshot()), "patchkit_slo_decisions_total", decision="scale_downs") == 2
        assert await release(frontend, clock, await hold(frontend, fast_calls=1, slow_calls=0)) == ["f0"]

    serve(clock, body, replicas={"fast": 3, "slow": 1}, min_replicas={"fast": 1}, batch_wait_ms=HOLD_MS)


def test_a_component_with_calls_queued_is_not_idle() -> None:
    clock = FakeClock()

    async def body(frontend: Frontend) -> None:
        held = await hold(frontend, fast_calls=1, slow_calls=0)
        assert await frontend.deployment.autoscaler.step(clock.now + 100.0) == []
        assert frontend.deployment.autoscaler.policy.idle_s("fast", clock.now) is None
        await release(frontend, clock, held)

    serve(clock, body, replicas={"fast": 2}, min_replicas={"fast": 1}, batch_wait_ms=HOLD_MS)


# -- no failed call while replicas come and go --------------------------------------------------------
def test_a_stream_of_queries_loses_none_while_a_replica_is_added_and_one_retired() -> None:
    clock = FakeClock()
    seen: dict[str, Any] = {}

    async def body(frontend: Frontend) -> list[str]:
        queries: list[asyncio.Future[RequestResult]] = []

        async def stream() -> None:  # bursts of 10 queries, faster than two replicas serve them one at a time
            for i in range(0, 300, 10):
                queries.extend(asyncio.ensure_future(frontend.query({"query": f"s{j}"})) for j in range(i, i + 10))
                await asyncio.sleep(0)

        streaming = asyncio.ensure_future(stream())
        state, frontend.deployment.autoscaler.policy.capacity = put_at_risk(frontend), {"cpu": 8}
        await frontend.deployment.autoscaler.step(clock.now)
        await first_busy(frontend, "slow")
        [up] = await frontend.deployment.autoscaler.step(clock.now + 2.0)  # added while calls flow
        assert (up.component, len(frontend.deployment.sets["slow"].replicas)) == ("slow", 3)
        busy = await first_busy(frontend, "slow")
        seen["inflight"] = busy.inflight
        stopped = frontend.deployment.supervisor.retire(busy)  # with a batch sent (inprocess: it runs within this loop turn)
        assert stopped is not None
        await stopped
        seen["alive_after"], seen["kept"] = busy.alive, [r.id for r in frontend.deployment.supervisor.replicas("slow")]
        await streaming
        outputs = [r.output for r in await asyncio.gather(*queries)]
        frontend.policy.finish(state, ok=False)
        seen["stats"] = frontend.stats()
        return outputs

    # max_retries=0: a batch failed by a stopped replica would fail its request
    outputs = serve(clock, body, replicas={"slow": 2}, min_replicas=1, batch_size=1, max_inflight_batches=1, max_retries=0,
                    pause_admission=False)
    assert outputs == [f"s{i}" for i in range(300)]
    assert seen["inflight"] == 1 and not seen["alive_after"] and len(seen["kept"]) == 2
    stats = seen["stats"]
    assert stats["requests"]["ok"] == 300 and stats["requests"].get("error", 0) == 0
    assert stats["components"]["slow"]["methods"]["run"]["retries"] == 0 and stats["restarts"] == 0
    assert len(stats["components"]["slow"]["replicas"]) == 2


async def first_busy(frontend: Frontend, name: str) -> Any:
    """The first replica of `name` seen with a batch in flight."""
    for _ in range(10_000):
        busy = [r for r in frontend.deployment.sets[name].replicas if r.inflight]
        if busy:
            return busy[0]
        await asyncio.sleep(0)
    raise AssertionError(f"no replica of {name} had a batch in flight")


def test_a_replica_added_by_the_supervisor_is_restarted_like_the_others() -> None:
    async def body(frontend: Frontend) -> None:
        added = await frontend.deployment.supervisor.add(ReplicaSpec("slow", slow, ReplicaResources()))
        assert added.id == "slow#1" and added in frontend.deployment.sets["slow"].replicas
        await added.channel.close()  # it dies
        for _ in range(1_000):  # until the supervisor has restarted it (10 s at most: a bound, not a measure)
            if frontend.deployment.supervisor.restarts:
                break
            await asyncio.sleep(0.01)
        assert frontend.deployment.supervisor.restarts == 1
        assert [r.id for r in frontend.deployment.sets["slow"].replicas] == ["slow#0", "slow#2"]

    serve(FakeClock(), body)


def test_a_replica_needs_a_free_gpu_or_sees_none() -> None:
    assert one_more("cpu", 2 * SHARES_PER_CORE, set()) == ReplicaResources(threads=2, gpus=())  # two cores' threads
    assert one_more("cpu", 1, set()) == ReplicaResources(threads=1, gpus=())  # a share of a core: one thread
    assert one_more("gpu", 1, {0}, gpus=[0, 1]) == ReplicaResources(threads=1, gpus=(1,))
    assert one_more("gpu", 1, {0, 1}, gpus=[0, 1]) == ReplicaResources(threads=1, gpus=())


# -- the loop -----------------------------------------------------------------------------------------
def test_the_loop_started_by_the_front_end_scales_and_stops_with_it() -> None:
    async def main() -> tuple[int, int]:
        pipeline = routed()
        options = {"autoscale_interval_s": 0.01, "scale_up_after_s": 0.0, "plan": planned(100.0, 10.0, cpus=4)}
        config = DeploymentConfig.resolve(pipeline, backend="inprocess", **options)
        frontend = Frontend(pipeline, config, make_backend(config))
        await frontend.start()
        put_at_risk(frontend)
        for _ in range(500):
            if frontend.policy.counts["scale_ups"]:
                break
            await asyncio.sleep(0.01)
        grown = sum(replicas(frontend).values())
        await frontend.close()
        return grown, len(frontend.deployment.supervisor.replicas())

    grown, left = asyncio.run(main())
    assert grown >= 3 and left == 0


# -- configuration ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"min_replicas": 3, "max_replicas": 2}, ValueError, r"max_replicas \(2\) must be >= min_replicas \(3\)$"),
        ({"min_replicas": {"fast": 3}, "max_replicas": 2}, ValueError,
         r"max_replicas \(2\) must be >= min_replicas \(3\) for 'fast'"),
        ({"replicas": 3, "max_replicas": {"slow": 2}}, ValueError, r"replicas \(3\) must be <= max_replicas \(2\) for 'slow'"),
        ({"min_replicas": {"fast": 2}}, ValueError, r"replicas \(1\) must be >= min_replicas \(2\) for 'fast'"),
        ({"min_replicas": 0}, ValueError, "min_replicas must be >= 1; got 0"),
        ({"max_replicas": {"slwo": 2}}, patchkit.ConfigError, "max_replicas names 'slwo'.*did you mean 'slow'"),
        ({"autoscale_interval_s": 0}, ValueError, "autoscale_interval_s must be > 0"),
        ({"scale_down_after_s": -1}, ValueError, "scale_down_after_s must be >= 0"),
    ],
)
def test_config_errors_name_the_values_in_conflict(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        DeploymentConfig.resolve(routed(), **options)


def test_replica_bounds_default_to_as_deployed_and_no_limit() -> None:
    config = DeploymentConfig.resolve(routed(), replicas={"fast": 2}, max_replicas={"slow": 4})
    assert (config.min_replicas_of("fast"), config.max_replicas_of("fast")) == (2, None)
    assert (config.min_replicas_of("slow"), config.max_replicas_of("slow")) == (1, 4)
    described = json.loads(json.dumps(config.describe()))
    assert described["max_replicas"] == {"slow": 4} and described["autoscale"] is True


# -- real worker processes ----------------------------------------------------------------------------
@pytest.mark.slow
def test_the_running_autoscaler_adds_a_worker_process_and_no_query_fails() -> None:
    pipeline = simulated()
    plan = Plan({"sim": ComponentPlan("cpu", 1, 1, throughput=20.0)}, 20.0, "sim", capacity={"cpu": 2})
    options = {"autoscale_interval_s": 0.1, "scale_up_after_s": 0.3, "scale_down_after_s": 1.0, "pause_admission": False}
    with patchkit.deploy(pipeline, plan=plan, slo_ms=300, **options) as endpoint:
        outcomes = load_until_grown(endpoint)
        stats = endpoint.stats()
        assert len(stats["components"]["sim"]["replicas"]) == 2  # the cpu capacity: 2 units
        assert all(ok for ok, _ in outcomes) and [v for _, v in outcomes] == [f"q{i}" for i in range(len(outcomes))]
        assert stats["requests"]["ok"] == len(outcomes) and stats["slo"]["scale_ups"] >= 1
        pids = {r["pid"] for r in stats["components"]["sim"]["replicas"]}
        assert len(pids) == 2
        shrunk = wait_for(lambda: len(endpoint.stats()["components"]["sim"]["replicas"]) == 1, 30.0)
        assert shrunk and endpoint.stats()["slo"]["scale_downs"] >= 1 and endpoint.stats()["restarts"] == 0
        assert endpoint.query(query="after") == "after"


@pytest.mark.slow
def test_a_worker_retired_with_a_batch_in_flight_finishes_it_first() -> None:
    """On the inprocess backend a batch is done within the loop turn it starts in; a worker process
    holds one for 50 ms, so here retiring must wait for it: with max_retries=0, a batch failed by
    stopping the worker early would fail its request."""

    async def main() -> tuple[list[Any], tuple[int, int, bool], dict[str, Any]]:
        pipeline = simulated("q")
        config = DeploymentConfig.resolve(pipeline, backend="local", secret="s", autoscale=False, replicas=2, min_replicas=1,
                                          max_retries=0, max_inflight_batches=1)
        frontend = Frontend(pipeline, config, make_backend(config))
        await frontend.start()
        try:
            queries = [asyncio.ensure_future(frontend.query({"query": f"q{i}"})) for i in range(8)]
            busy = await first_busy(frontend, "sim")
            sent = busy.inflight
            stopped = frontend.deployment.supervisor.retire(busy)
            assert stopped is not None
            await stopped
            drained = (sent, busy.inflight, busy.alive)
            outputs = [r.output for r in await asyncio.gather(*queries)]
            return outputs, drained, frontend.stats()
        finally:
            await frontend.close()

    outputs, drained, stats = asyncio.run(main())
    assert outputs == [f"q{i}" for i in range(8)]
    assert drained == (1, 0, False)  # retired with a batch in flight, stopped once it came back
    run = stats["components"]["sim"]["methods"]["run"]
    assert run["failures"] == 0 and run["retries"] == 0 and stats["restarts"] == 0  # that batch was answered
    assert len(stats["components"]["sim"]["replicas"]) == 1


def load_until_grown(endpoint: patchkit.Endpoint, clients: int = 8) -> list[tuple[bool, Any]]:
    """Closed-loop queries from `clients` threads until a second replica serves, then 40 more each."""
    grown, lock, counter = threading.Event(), threading.Lock(), iter(range(1_000_000))
    results: dict[int, tuple[bool, Any]] = {}

    def client() -> None:
        extra = 40
        while extra and time.monotonic() < deadline:
            with lock:
                i = next(counter)
            try:
                results[i] = (True, endpoint.query(query=f"q{i}"))
            except Exception as exc:
                results[i] = (False, exc)
            extra -= grown.is_set()

    deadline = time.monotonic() + 60.0
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    if wait_for(lambda: len(endpoint.stats()["components"]["sim"]["replicas"]) == 2, 60.0):
        grown.set()
    for thread in threads:
        thread.join()
    assert grown.is_set(), "no replica was added within 60 s"
    return [results[i] for i in sorted(results)]


def wait_for(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False
