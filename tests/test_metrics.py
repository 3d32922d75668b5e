"""`GET /metrics` through prometheus_client: parsed as Prometheus parses it, from real deployments.

Conventional names and types, the request-duration histogram agreeing with the request counts, label
values with newlines and quotes escaped, a registry per deployment, and the event loop's lag.
"""

from __future__ import annotations

import asyncio
import selectors
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families
from serving import metric

import patchkit
from patchkit import Component, make
from patchkit.server.loop_lag import LoopLag

ODD_STAT = 'a "quoted"\nstat\\name'  # a stats() key a label must carry intact


class Echo(Component):
    """Answers with its input and reports figures under an awkward name, nested."""

    def __init__(self) -> None:
        self.seen = 0

    @make
    def echo(self, text: str) -> str:
        self.seen += 1
        return text

    def stats(self) -> dict[str, Any]:
        return {ODD_STAT: 7, "cache": {"hits": self.seen}}


def _pipeline() -> patchkit.Pipeline:
    echo = Echo()
    text = "x"
    with patchkit.capture(run=False) as pipeline:
        out = echo.echo(text)  # noqa: F841 - the pipeline's output
    return pipeline


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as reply:  # noqa: S310 - a local test server
        assert reply.headers["Content-Type"].startswith("text/plain")
        return str(reply.read().decode())


@pytest.fixture(scope="module")
def served() -> Iterator[patchkit.Endpoint]:
    with patchkit.deploy(_pipeline(), backend="inprocess") as endpoint:
        yield endpoint


def test_families_have_conventional_names_and_types(served: patchkit.Endpoint) -> None:
    for text in ("a", "b", "c"):
        served.query(text=text)
    types = {family.name: family.type for family in text_string_to_metric_families(_scrape(served.url))}
    expected = {
        "patchkit_requests": "counter", "patchkit_requests_inflight": "gauge", "patchkit_requests_slo_met": "counter",
        "patchkit_request_duration_seconds": "histogram", "patchkit_calls": "counter", "patchkit_batches": "counter",
        "patchkit_call_failures": "counter", "patchkit_call_retries": "counter", "patchkit_queue_length": "gauge",
        "patchkit_queue_wait_seconds": "counter", "patchkit_batch_service_seconds": "counter",
        "patchkit_batch_size_max": "gauge", "patchkit_replicas": "gauge", "patchkit_replica_state": "gauge",
        "patchkit_replica_restarts": "counter", "patchkit_component_stat": "gauge", "patchkit_slo_decisions": "counter",
        "patchkit_slo_at_risk_requests": "gauge", "patchkit_admission_waiting_requests": "gauge",
        "patchkit_prefetch": "counter", "patchkit_prefetch_bytes": "counter", "patchkit_event_loop_lag_seconds": "gauge",
        "patchkit_event_loop_lag_max_seconds": "gauge",
    }
    assert {name: types.get(name) for name in expected} == expected


def test_request_counts_and_the_duration_histogram_agree(served: patchkit.Endpoint) -> None:
    before = metric(_scrape(served.url), "patchkit_requests_total", outcome="ok")
    for text in ("d", "e"):
        served.query(text=text)
    text = _scrape(served.url)
    ok = metric(text, "patchkit_requests_total", outcome="ok")
    assert ok == before + 2
    assert metric(text, "patchkit_requests_total", outcome="cancelled") == 0  # shown before it ever happens
    [duration] = [f for f in text_string_to_metric_families(text) if f.name == "patchkit_request_duration_seconds"]
    buckets = [s.value for s in duration.samples if s.name.endswith("_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == ok  # cumulative, +Inf holds every answered request
    assert metric(text, "patchkit_request_duration_seconds_count") == ok
    assert metric(text, "patchkit_request_duration_seconds_sum") > 0
    assert metric(text, "patchkit_calls_total", component="echo", method="echo") == ok
    assert metric(text, "patchkit_batch_size_max", component="echo", method="echo") >= 1


def test_label_values_with_newlines_and_quotes_come_back_intact(served: patchkit.Endpoint) -> None:
    text = _scrape(served.url)
    [replica] = served.stats()["replica_reports"]
    assert metric(text, "patchkit_component_stat", component="echo", replica=replica, stat=ODD_STAT) == 7
    assert metric(text, "patchkit_component_stat", component="echo", replica=replica, stat="cache_hits") >= 1
    assert metric(text, "patchkit_replica_state", component="echo", replica=replica, state="serving") == 1


def test_each_deployment_has_a_registry_of_its_own(served: patchkit.Endpoint) -> None:
    assert not [name for name in REGISTRY._names_to_collectors if name.startswith("patchkit_")]
    served.query(text="here")
    before = metric(_scrape(served.url), "patchkit_requests_total", outcome="ok")
    with patchkit.deploy(_pipeline(), backend="inprocess") as other:
        other.query(text="there")
        assert metric(_scrape(other.url), "patchkit_requests_total", outcome="ok") == 1
    assert metric(_scrape(served.url), "patchkit_requests_total", outcome="ok") == before


class VirtualClock:
    """A loop's time in seconds, moved by the loop as it waits and by the test."""

    def __init__(self) -> None:
        self.now = 0.0


class SkippingSelector(selectors.DefaultSelector):
    """Waits for nothing: a wait for the next timer moves the clock to it at once."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__()
        self.clock = clock

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is not None and timeout > 0:
            self.clock.now += timeout
            timeout = 0
        return list(super().select(timeout))


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a clock of its own, which only moves on to the next timer, or when a test moves it."""

    def __init__(self, clock: VirtualClock) -> None:
        super().__init__(SkippingSelector(clock))
        self.clock = clock

    def time(self) -> float:
        return self.clock.now


def test_loop_lag_sees_a_blocked_loop() -> None:
    clock = VirtualClock()

    async def main() -> tuple[float, float]:
        lag = LoopLag(interval_s=0.01)
        lag.start()
        await asyncio.sleep(0.05)
        clock.now += 0.3  # a blocking call in pipeline code: the loop's time runs on while no task runs
        await asyncio.sleep(0.05)
        await lag.stop()
        return lag.last_s, lag.max_s

    loop = VirtualTimeLoop(clock)
    try:
        last, largest = loop.run_until_complete(main())
    finally:
        loop.close()
    assert largest == pytest.approx(0.3, abs=0.01)  # the tick due during the block ran 0.3 s late, less its interval
    assert last == pytest.approx(0.0, abs=1e-9)  # the ticks after it ran on time


def test_loop_lag_forgets_past_its_window() -> None:
    lag = LoopLag(window_s=10.0)
    lag.record(100.0, 0.5)
    lag.record(105.0, 0.01)
    assert lag.max_s == 0.5
    lag.record(111.0, 0.02)
    assert (lag.last_s, lag.max_s) == (0.02, 0.02)


@pytest.mark.slow
def test_metrics_of_a_deployment_on_worker_processes() -> None:
    with patchkit.deploy(_pipeline(), replicas=2) as endpoint:
        for text in ("a", "b", "c", "d"):
            assert endpoint.query(text=text) == text
        text = _scrape(endpoint.url)
        replicas = endpoint.stats()["replica_reports"]
    assert metric(text, "patchkit_requests_total", outcome="ok") == 4
    assert metric(text, "patchkit_replicas", component="echo") == 2
    assert len(replicas) == 2
    for replica in replicas:  # each worker's own stats(), from its own process
        assert metric(text, "patchkit_component_stat", component="echo", replica=replica, stat=ODD_STAT) == 7
        assert metric(text, "patchkit_replica_state", component="echo", replica=replica, state="serving") == 1
    seen = sum(metric(text, "patchkit_component_stat", component="echo", replica=r, stat="cache_hits") for r in replicas)
    assert seen == 4  # run=False: no eager call counted, every call ran on a worker
    assert metric(text, "patchkit_event_loop_lag_max_seconds") >= 0
