"""`GET /metrics`: the deployment's state in the Prometheus text format, through `prometheus_client`.

A custom collector (`FrontendCollector`) reads the front-end's state when scraped, from a
`FrontendSnapshot` and the replicas' own reports, on a registry of the deployment's own (several
deployments share one process in tests, so never the global default registry). Names follow
Prometheus conventions: seconds for times, `_total` for counters.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from patchkit.server.loop_lag import LoopLag
from patchkit.serving.snapshot import LATENCY_BUCKETS_S, FrontendSnapshot, MethodSnapshot

__all__ = ["CONTENT_TYPE", "DeploymentMetrics", "FrontendCollector", "catalogue", "render_metrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Request outcomes shown even at zero, so that a rate over them exists from the first scrape; any other
# outcome the front-end counts is shown as well.
OUTCOMES = ("ok", "error", "worker_died", "timeout", "overloaded", "cancelled")
# SloPolicy.stats() keys counted as decisions, and the label value each is shown as.
SLO_DECISIONS = {
    "at_risk_total": "at_risk", "beyond_saving_total": "beyond_saving", "prioritized_calls": "prioritized_calls",
    "admission_paused": "admission_paused", "admission_rejected": "admission_rejected", "scale_ups": "scale_ups",
    "scale_downs": "scale_downs",
}
PREFETCH_OUTCOMES = ("issued", "done", "failed", "skipped", "cancelled")
METHOD_LABELS = ["component", "method"]


class FrontendCollector:
    """A `prometheus_client` collector: every `collect()` (one per scrape) reads a fresh snapshot.

    `snapshot` is `StatsCollector.snapshot`; `reports` is what the replicas last reported about themselves
    (`StatsCollector.replica_stats`, asked by `DeploymentMetrics.scrape` right before), None to leave the
    per-replica component figures out; `lag` is the front-end loop's lag monitor, if one runs.
    """

    def __init__(self, snapshot: Callable[[], FrontendSnapshot], lag: LoopLag | None = None) -> None:
        self._snapshot = snapshot
        self.lag = lag
        self.reports: Mapping[str, Mapping[str, Any]] | None = None

    def collect(self) -> Iterator[Metric]:
        snapshot = self._snapshot()
        yield from _requests(snapshot)
        yield from _methods(snapshot)
        yield from _replicas(snapshot)
        if self.reports is not None:
            yield _component_stats(snapshot, self.reports)
        yield from _slo(snapshot.slo)
        yield from _prefetch(snapshot.prefetch)
        if self.lag is not None:
            yield GaugeMetricFamily("patchkit_event_loop_lag_seconds", "How late the front-end's event loop woke "
                                    "from its last timed sleep.", value=self.lag.last_s)
            yield GaugeMetricFamily("patchkit_event_loop_lag_max_seconds", "The largest event loop lag over the last "
                                    f"{self.lag.window_s:g} s.", value=self.lag.max_s)


class DeploymentMetrics:
    """The deployment's registry and its collector; `/metrics` calls `scrape` on the front-end's loop."""

    def __init__(
        self,
        snapshot: Callable[[], FrontendSnapshot],
        replica_stats: Callable[[], Awaitable[Mapping[str, Mapping[str, Any]]]],
        lag: LoopLag | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = FrontendCollector(snapshot, lag)
        self.registry.register(self.collector)
        self._replica_stats = replica_stats

    async def scrape(self) -> bytes:
        """The exposition text: the replicas are asked for their reports, then the registry is collected
        with no await in between, so two scrapes at once each render their own reports."""
        self.collector.reports = await self._replica_stats()
        return generate_latest(self.registry)


def render_metrics(
    snapshot: FrontendSnapshot, reports: Mapping[str, Mapping[str, Any]] | None = None, lag: LoopLag | None = None
) -> str:
    """The exposition text of one snapshot, for tests and tools that hold a `Frontend` rather than an endpoint."""
    collector = FrontendCollector(lambda: snapshot, lag)
    collector.reports = reports
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry).decode()


def _requests(snapshot: FrontendSnapshot) -> Iterator[Metric]:
    outcomes = CounterMetricFamily("patchkit_requests", "Requests by outcome.", labels=["outcome"])
    for outcome in sorted({*OUTCOMES, *snapshot.outcomes}):
        outcomes.add_metric([outcome], snapshot.outcomes.get(outcome, 0))
    yield outcomes
    by_pipeline = CounterMetricFamily("patchkit_pipeline_requests", "Requests a pipeline ran, by its name, its version "
                                      "(number-digest; 'retired': its versions that no longer serve) and their outcome.",
                                      labels=["pipeline", "version", "outcome"])
    for (pipeline, version, outcome), count in sorted(snapshot.pipelines.items()):
        by_pipeline.add_metric([pipeline, version, outcome], count)
    yield by_pipeline
    yield GaugeMetricFamily("patchkit_requests_inflight", "Requests running now.", value=snapshot.inflight)
    yield CounterMetricFamily("patchkit_requests_slo_met", "Requests answered within their SLO.", value=snapshot.slo_met)
    cumulative, buckets = 0, []
    for bound, count in zip([*LATENCY_BUCKETS_S, float("inf")], snapshot.latency_buckets):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else f"{bound:g}", float(cumulative)))
    duration = HistogramMetricFamily("patchkit_request_duration_seconds", "Time from admission to answer of the "
                                     "requests answered.")
    duration.add_metric([], buckets, snapshot.latency_sum_s)
    yield duration


def _methods(snapshot: FrontendSnapshot) -> Iterator[Metric]:
    """One series per component method (its batching queue)."""
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
        "calls": CounterMetricFamily("patchkit_calls", "Component calls answered.", labels=METHOD_LABELS),
        "batches": CounterMetricFamily("patchkit_batches", "Batches run.", labels=METHOD_LABELS),
        "failures": CounterMetricFamily("patchkit_call_failures", "Calls that raised.", labels=METHOD_LABELS),
        "retries": CounterMetricFamily("patchkit_call_retries", "Calls sent again after their replica was lost.",
                                       labels=METHOD_LABELS),
        "queue_wait_s": CounterMetricFamily("patchkit_queue_wait_seconds", "Time calls spent queued, summed.",
                                            labels=METHOD_LABELS),
        "service_s": CounterMetricFamily("patchkit_batch_service_seconds", "Time batches took on their replicas, summed.",
                                         labels=METHOD_LABELS),
        "queue_length": GaugeMetricFamily("patchkit_queue_length", "Calls waiting for a batch.", labels=METHOD_LABELS),
        "batch_size": GaugeMetricFamily("patchkit_batch_size_max", "The most calls one batch takes (the configured "
                                        "batch size).", labels=METHOD_LABELS),
        "throughput_per_s": GaugeMetricFamily("patchkit_calls_per_second", "Calls answered per second over the "
                                              "queue's recent window.", labels=METHOD_LABELS),
    }
    for method in snapshot.methods:
        for field, family in families.items():
            family.add_metric([method.component, method.method], getattr(method, field))
    yield from families.values()


def _replicas(snapshot: FrontendSnapshot) -> Iterator[Metric]:
    live = GaugeMetricFamily("patchkit_replicas", "Live replicas per component.", labels=["component"])
    for component, count in sorted(snapshot.live_replicas.items()):
        live.add_metric([component], count)
    yield live
    state = GaugeMetricFamily("patchkit_replica_state", "1 for each replica in its state (serving, stuck, unhealthy, "
                              "dead: out of service until replaced).", labels=["component", "replica", "state"])
    for replica, (component, name) in sorted(snapshot.replica_states.items()):
        state.add_metric([component, replica, name], 1)
    yield state
    yield CounterMetricFamily("patchkit_replica_restarts", "Replicas started in place of lost ones.", value=snapshot.restarts)
    failed = GaugeMetricFamily("patchkit_component_failed", "1 for a component whose replicas die by a signal in native "
                               "code at every start: its calls fail at once (503) until an update.", labels=["component"])
    for component in sorted(snapshot.live_replicas):
        failed.add_metric([component], float(component in snapshot.failed))
    yield failed


def _component_stats(snapshot: FrontendSnapshot, reports: Mapping[str, Mapping[str, Any]]) -> Metric:
    """Each replica's component figures (its `stats()`), nested dicts flattened into the `stat` label."""
    family = GaugeMetricFamily("patchkit_component_stat", "A component's own figures (its stats()), per replica.",
                               labels=["component", "replica", "stat"])
    component_of = snapshot.replica_components
    for replica, report in sorted(reports.items()):
        for stat, value in _numbers(report.get("component_stats") or {}):
            family.add_metric([component_of.get(replica, ""), replica, stat], value)
    return family


def _slo(slo: Mapping[str, Any]) -> Iterator[Metric]:
    yield GaugeMetricFamily("patchkit_slo_at_risk_requests", "Requests in flight at risk of missing their SLO.",
                            value=slo["at_risk_now"])
    decisions = CounterMetricFamily("patchkit_slo_decisions", "SLO policy decisions, by kind.", labels=["decision"])
    for key, label in SLO_DECISIONS.items():
        decisions.add_metric([label], slo[key])
    yield decisions
    yield GaugeMetricFamily("patchkit_admission_waiting_requests", "Requests waiting while admission is paused.",
                            value=slo["admission_waiting"])


def _prefetch(prefetch: Mapping[str, Any]) -> Iterator[Metric]:
    calls = CounterMetricFamily("patchkit_prefetch", "Lookahead prefetch calls the front-end inserted, by outcome.",
                                labels=["outcome"])
    for outcome in PREFETCH_OUTCOMES:
        calls.add_metric([outcome], prefetch[outcome])
    yield calls
    yield CounterMetricFamily("patchkit_prefetch_bytes", "Bytes the retrievers' prefetches asked to copy.",
                              value=prefetch["bytes_requested"])


def _numbers(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The numbers of a component's stats, nested dicts flattened with "_" (booleans count as 0/1)."""
    for key, value in data.items():
        if isinstance(value, (bool, int, float)):
            yield f"{prefix}{key}", float(value)
        elif isinstance(value, Mapping):
            yield from _numbers(value, f"{prefix}{key}_")


def catalogue() -> list[tuple[str, str, tuple[str, ...], str]]:
    """Every metric `/metrics` shows, as (name, type, labels, help), in the order it shows them.

    Read from the collector itself, on a snapshot with one of everything (a method, a replica, a pipeline, a
    component's figure), so that the documentation's list of metrics is made from the code that serves them.
    """
    snapshot = FrontendSnapshot(
        outcomes={}, inflight=0, slo_met=0, latency_buckets=(0,) * (len(LATENCY_BUCKETS_S) + 1), latency_sum_s=0.0,
        methods=(MethodSnapshot("c", "m", 1, 0, 0, 0, 0, 0, 0.0, 0.0, 0.0),), live_replicas={"c": 1},
        replica_components={"c#0": "c"}, replica_states={"c#0": ("c", "serving")}, restarts=0,
        slo={"at_risk_now": 0, "admission_waiting": 0, **dict.fromkeys(SLO_DECISIONS, 0)},
        prefetch={"bytes_requested": 0, **dict.fromkeys(PREFETCH_OUTCOMES, 0)}, pipelines={("p", "1-0", "ok"): 0},
    )
    collector = FrontendCollector(lambda: snapshot, LoopLag())
    collector.reports = {"c#0": {"component_stats": {"stat": 0}}}
    found = []
    for metric in collector.collect():
        suffix = {"counter": "_total"}.get(metric.type, "")
        labels = tuple(dict.fromkeys(k for s in metric.samples for k in s.labels if k != "le"))
        found.append((metric.name + suffix, metric.type, labels, metric.documentation))
    return found
