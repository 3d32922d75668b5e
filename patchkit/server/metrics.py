"""`GET /metrics`: the front-end's counters in the Prometheus text format, rendered from a
`FrontendSnapshot` taken at scrape time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from patchkit.scheduler.online.snapshot import LATENCY_BUCKETS_S, FrontendSnapshot

__all__ = ["render_metrics"]


def _labels(**labels: str) -> str:
    if not labels:
        return ""
    escaped = (f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in labels.items())
    return "{" + ",".join(escaped) + "}"


def _family(name: str, kind: str, help_text: str, samples: Iterable[tuple[str, dict[str, str], float]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{suffix}{_labels(**labels)} {value:g}" for suffix, labels, value in samples]
    return lines


def render_metrics(snapshot: FrontendSnapshot, reports: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """Prometheus text for the front-end's state (`Frontend.snapshot()`); `reports` (replica id -> what
    the replica reported, as `Frontend.replica_stats` gathers) adds each component's own `stats()` figures."""
    lines: list[str] = []
    outcomes = snapshot.outcomes
    lines += _family("patchkit_requests_total", "counter", "Requests by outcome.",
                     [("", {"outcome": k}, v) for k, v in sorted(outcomes.items())])
    lines += _family("patchkit_requests_inflight", "gauge", "Requests running now.", [("", {}, snapshot.inflight)])
    lines += _family("patchkit_requests_slo_met_total", "counter", "Requests answered within their SLO.",
                     [("", {}, snapshot.slo_met)])
    cumulative, buckets = 0, list[tuple[str, dict[str, str], float]]()
    for bound, count in zip([*LATENCY_BUCKETS_S, float("inf")], snapshot.latency_buckets):
        cumulative += count
        buckets.append(("_bucket", {"le": "+Inf" if bound == float("inf") else f"{bound:g}"}, cumulative))
    buckets += [("_sum", {}, snapshot.latency_sum_s), ("_count", {}, cumulative)]
    lines += _family("patchkit_request_latency_seconds", "histogram", "Latency of answered requests.", buckets)
    per_method: dict[str, list[tuple[str, dict[str, str], float]]] = {
        "calls": [], "batches": [], "failures": [], "retries": [], "queue_length": [], "queue_wait": [], "batch_size": [],
    }
    for m in snapshot.methods:
        labels = {"component": m.component, "method": m.method}
        per_method["calls"].append(("", labels, m.calls))
        per_method["batches"].append(("", labels, m.batches))
        per_method["failures"].append(("", labels, m.failures))
        per_method["retries"].append(("", labels, m.retries))
        per_method["queue_length"].append(("", labels, m.queue_length))
        per_method["queue_wait"].append(("", labels, m.queue_wait_s))
        per_method["batch_size"].append(("", labels, m.batch_size))
    lines += _family("patchkit_calls_total", "counter", "Component calls answered.", per_method["calls"])
    lines += _family("patchkit_batches_total", "counter", "Batches run.", per_method["batches"])
    lines += _family("patchkit_call_failures_total", "counter", "Calls that raised.", per_method["failures"])
    lines += _family("patchkit_call_retries_total", "counter", "Calls re-sent after their replica died.", per_method["retries"])
    lines += _family("patchkit_queue_length", "gauge", "Calls waiting for a batch.", per_method["queue_length"])
    lines += _family("patchkit_queue_wait_seconds_total", "counter", "Time calls spent queued.", per_method["queue_wait"])
    lines += _family("patchkit_batch_size", "gauge", "Configured batch size.", per_method["batch_size"])
    if reports is not None:
        lines += _family("patchkit_component_stat", "gauge", "A component's own figures (its stats()), per replica.",
                         _component_samples(snapshot, reports))
    replicas = [("", {"component": n}, live) for n, live in snapshot.live_replicas.items()]
    lines += _family("patchkit_replicas", "gauge", "Live replicas per component.", replicas)
    lines += _family("patchkit_replica_restarts_total", "counter", "Replicas restarted after dying.",
                     [("", {}, snapshot.restarts)])
    slo = snapshot.slo
    lines += _family("patchkit_slo_at_risk_requests", "gauge", "Requests in flight at risk of missing their SLO.",
                     [("", {}, slo["at_risk_now"])])
    lines += _family("patchkit_slo_decisions_total", "counter", "SLO policy decisions, by kind.",
                     [("", {"decision": k}, slo[k]) for k in ("at_risk_total", "beyond_saving_total", "prioritized_calls",
                                                               "admission_paused", "admission_rejected", "scale_ups",
                                                               "scale_downs")])
    lines += _family("patchkit_admission_waiting", "gauge", "Requests waiting while admission is paused.",
                     [("", {}, slo["admission_waiting"])])
    prefetch = snapshot.prefetch
    lines += _family("patchkit_prefetch_total", "counter", "Lookahead prefetch calls the front-end inserted, by outcome.",
                     [("", {"outcome": k}, prefetch[k]) for k in ("issued", "done", "failed", "skipped", "cancelled")])
    lines += _family("patchkit_prefetch_bytes_total", "counter", "Bytes the retrievers' prefetches asked to copy.",
                     [("", {}, prefetch["bytes_requested"])])
    return "\n".join(lines) + "\n"


def _component_samples(
    snapshot: FrontendSnapshot, reports: Mapping[str, Mapping[str, Any]]
) -> list[tuple[str, dict[str, str], float]]:
    component_of = snapshot.replica_components
    samples = []
    for replica_id, report in sorted(reports.items()):
        for stat, value in _numbers(report.get("component_stats", {})):
            samples.append(("", {"component": component_of.get(replica_id, ""), "replica": replica_id, "stat": stat}, value))
    return samples


def _numbers(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """The numbers of a component's stats, nested dicts flattened with "_" (booleans count as 0/1)."""
    for key, value in data.items():
        if isinstance(value, (bool, int, float)):
            yield f"{prefix}{key}", float(value)
        elif isinstance(value, Mapping):
            yield from _numbers(value, f"{prefix}{key}_")
