"""The front-end's counters: requests by outcome and latency, and the views made from them and the deployment.

Every request the front-end refuses or runs is counted here once, under the name `outcome_of` gives
its end (runner.py counts what it runs, the HTTP edge what it refuses before). `snapshot()` feeds
`/metrics`, `stats()` `/v1/stats` and `Endpoint.stats()`, `healthy()` `/healthz`, `not_ready()` `/readyz` and
each pipeline's readiness.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from patchkit.scheduler.online.slo import SloPolicy
from patchkit.serving.deployment import Deployment
from patchkit.serving.snapshot import LATENCY_BUCKETS_S, FrontendSnapshot, MethodSnapshot
from patchkit.serving.steps import RecentRequests

__all__ = ["RETIRED", "StatsCollector"]

RETIRED = "retired"  # the version label of the requests of a pipeline's versions that no longer serve


class StatsCollector:
    """Counts requests as they end; reads the deployment, the SLO policy and the requests in flight
    (`inflight`, the runner's count) when asked for a view. On the front-end's event loop."""

    def __init__(self, deployment: Deployment, policy: SloPolicy, inflight: Callable[[], int]) -> None:
        self.deployment = deployment
        self.policy = policy
        self._inflight = inflight
        self.outcomes: Counter[str] = Counter()  # requests by result: ok, error, worker_died, timeout, overloaded, cancelled
        self.by_pipeline: Counter[tuple[str, str, str]] = Counter()  # (pipeline, version tag, outcome): those a runner ran
        self.slo_met = 0
        self.latency_buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.latency_sum_s = 0.0
        self.started = time.time()
        self.recent = RecentRequests()  # the last requests' calls, for the dashboard's timeline

    def count(self, outcome: str, pipeline: str | None = None, version: str = "") -> None:
        """A request ended with `outcome` (see `outcome_of`); one a pipeline's runner ran counts under its name and
        version too (one the edge refused never reached a pipeline)."""
        self.outcomes[outcome] += 1
        if pipeline is not None:
            self.by_pipeline[pipeline, version, outcome] += 1

    def retire(self, pipeline: str, version: str) -> None:
        """Version `version` of `pipeline` has ended its last request: its counts join the pipeline's "retired" ones,
        so that the series `/metrics` shows stay as many however many updates come, each pipeline's sums kept."""
        for key in [key for key in self.by_pipeline if key[:2] == (pipeline, version)]:
            self.by_pipeline[pipeline, RETIRED, key[2]] += self.by_pipeline.pop(key)

    def answered(self, latency_s: float, slo_ms: float | None, pipeline: str | None = None, version: str = "") -> None:
        """A request was answered after `latency_s`, within its SLO or not (counted as "ok" too)."""
        self.count("ok", pipeline, version)
        self.latency_sum_s += latency_s
        bucket = next((i for i, bound in enumerate(LATENCY_BUCKETS_S) if latency_s <= bound), len(LATENCY_BUCKETS_S))
        self.latency_buckets[bucket] += 1
        if slo_ms is not None and latency_s * 1000 <= slo_ms:
            self.slo_met += 1

    def healthy(self) -> bool:
        """Whether every component has a healthy replica (alive, serving, its last health check passed): `/healthz`."""
        # An update's new components serve nothing yet; those it retires serve nothing any more.
        passing = {*self.deployment.starting, *self.deployment.retiring}
        return all(any(r.healthy for r in s.replicas) for n, s in self.deployment.sets.items() if n not in passing)

    def not_ready(self) -> dict[str, tuple[str, list[str]]]:
        """Each component not wholly ready, by name: its state and why, a line per replica. "failed" (see
        `Deployment.fail`; its line says what kind of failure), "unready" (no replica serves: each is being
        replaced, gone or failing its health checks) or "degraded" (one serves, another does not). Those ready
        are left out. Read by `Frontend.readiness` (`/readyz`, which asks no token), so each line names the
        replica and its state, never its error text."""
        supervisor, deployment = self.deployment.supervisor, self.deployment
        found: dict[str, tuple[str, list[str]]] = {}
        for name, replica_set in deployment.sets.items():
            if name in deployment.starting or name in deployment.retiring:
                continue  # an update's new component, serving nothing until all of it is up; or one no version calls
            if name in supervisor.failed:
                found[name] = ("failed", [f"{name} is failed: {supervisor.failure_kinds[name]}"])
                continue
            lines = [f"{r.id} is {r.state.value}; another is starting in its place" for r in supervisor.replacing(name)]
            for replica in replica_set.replicas:
                if not replica.alive:
                    lines.append(f"{replica.id} is gone")
                elif replica.failed_checks:
                    lines.append(f"{replica.id} failed its last {replica.failed_checks} health checks")
            if not replica_set.replicas and not lines:
                lines.append(f"{name} has no replica serving")
            if lines:
                found[name] = ("degraded" if any(r.healthy for r in replica_set.replicas) else "unready", lines)
        return found

    def snapshot(self) -> FrontendSnapshot:
        """The counters at this moment, for `/metrics` and `stats()`."""
        now = time.monotonic()
        deployment, supervisor = self.deployment, self.deployment.supervisor
        methods = tuple(
            MethodSnapshot(
                name, queue.method, queue.batch_size, len(queue), queue.stats.calls, queue.stats.batches,
                queue.stats.failures, queue.stats.retries, queue.stats.queue_wait_s, queue.stats.service_s,
                queue.stats.throughput(now),
            )
            for name, replica_set in deployment.sets.items()
            for queue in replica_set.queues
        )
        return FrontendSnapshot(
            outcomes=dict(self.outcomes), inflight=self._inflight(), slo_met=self.slo_met,
            latency_buckets=tuple(self.latency_buckets), latency_sum_s=self.latency_sum_s, methods=methods,
            live_replicas={name: sum(r.alive for r in s.replicas) for name, s in deployment.sets.items()},
            replica_components={replica.id: replica.component for replica in supervisor.replicas()},
            replica_states={r.id: (r.component, r.state.value) for r in [*supervisor.replicas(), *supervisor.replacing()]},
            restarts=supervisor.restarts, slo=self.policy.stats(), prefetch=deployment.prefetcher.stats(),
            pipelines=dict(self.by_pipeline), failed=frozenset(supervisor.failed),
        )

    def stats(self) -> dict[str, Any]:
        """Per component: replicas, per method batch size, throughput and queue, and the replicas replaced
        lately (dead, stuck, unhealthy) with why; called by /v1/stats."""
        snapshot = self.snapshot()
        deployment, supervisor = self.deployment, self.deployment.supervisor
        components: dict[str, dict[str, Any]] = {
            name: {"class": type(component).__name__, "replicas": self._replicas(name), "methods": {},
                   "replaced": [r.describe() for r in supervisor.replaced if r.component == name],
                   "state": "failed" if name in supervisor.failed else "serving"}
            for name, component in deployment.components.items()
        }
        for name, why in supervisor.failed.items():
            if name in components:
                components[name]["failed"] = why
        for method in snapshot.methods:
            components[method.component]["methods"][method.method] = method.describe()
        requests: dict[str, float] = {"inflight": snapshot.inflight, **snapshot.outcomes}
        if snapshot.outcomes.get("ok"):
            requests["mean_latency_ms"] = 1000 * snapshot.latency_sum_s / snapshot.outcomes["ok"]
        pipelines: dict[str, dict[str, dict[str, int]]] = {}
        for (pipeline, version, outcome), count in sorted(snapshot.pipelines.items()):
            pipelines.setdefault(pipeline, {}).setdefault(version, {})[outcome] = count
        return {"backend": supervisor.backend.name, "uptime_s": time.time() - self.started, "requests": requests,
                "pipelines": pipelines,
                "restarts": snapshot.restarts, "slo": dict(snapshot.slo), "prefetch": dict(snapshot.prefetch),
                "components": components}

    def _replicas(self, name: str) -> list[dict[str, Any]]:
        """The component's replicas in service, then those out of it until another replaces each (dead, stuck,
        unhealthy), with their `state` and `why`."""
        replacing = self.deployment.supervisor.replacing(name)
        return [r.describe() for r in [*self.deployment.sets[name].replicas, *replacing]]

    async def replica_stats(self) -> dict[str, Any]:
        """What each replica reports about itself (pid, pinning, batches run, its component's own
        stats()), asked of all at once; a replica that cannot answer reports its error."""
        replicas = list(self.deployment.supervisor.replicas())
        reports = await asyncio.gather(*(replica.channel.stats() for replica in replicas), return_exceptions=True)
        return {
            replica.id: {"error": str(report)} if isinstance(report, BaseException) else report
            for replica, report in zip(replicas, reports)
        }
