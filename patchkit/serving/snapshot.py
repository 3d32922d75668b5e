"""What the front-end shows of itself: its counters at one moment, as plain data.

`StatsCollector.snapshot()` takes one; `/metrics` (`patchkit.server.metrics`) renders it and
`StatsCollector.stats()` (`/v1/stats`, `Endpoint.stats()`) reports it, so neither reaches into the
front-end's fields. Taking one is cheap: a pass over the queues and replicas, on the event loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["LATENCY_BUCKETS_S", "FrontendSnapshot", "MethodSnapshot"]

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class MethodSnapshot:
    """One component method's batching queue."""

    component: str
    method: str
    batch_size: int
    queue_length: int
    calls: int
    batches: int
    failures: int
    retries: int
    queue_wait_s: float  # summed over calls
    service_s: float  # summed over batches
    throughput_per_s: float  # over the queue's recent window

    def describe(self) -> dict[str, Any]:
        """As `StatsCollector.stats()` reports it, per method."""
        return {
            "batch_size": self.batch_size,
            "queue_length": self.queue_length,
            "calls": self.calls,
            "batches": self.batches,
            "mean_batch": self.calls / self.batches if self.batches else 0.0,
            "throughput_per_s": self.throughput_per_s,
            "mean_queue_wait_ms": 1000 * self.queue_wait_s / self.calls if self.calls else 0.0,
            "mean_batch_ms": 1000 * self.service_s / self.batches if self.batches else 0.0,
            "failures": self.failures,
            "retries": self.retries,
        }


@dataclass(frozen=True)
class FrontendSnapshot:
    """The front-end's state at one moment."""

    outcomes: Mapping[str, int]  # requests by result: ok, error, worker_died, timeout, overloaded
    inflight: int
    slo_met: int  # answered requests within their SLO
    latency_buckets: tuple[int, ...]  # answered requests per bucket of LATENCY_BUCKETS_S, then the rest
    latency_sum_s: float
    methods: tuple[MethodSnapshot, ...]
    live_replicas: Mapping[str, int]  # per component
    replica_components: Mapping[str, str]  # replica id -> its component
    replica_states: Mapping[str, tuple[str, str]]  # replica id -> (its component, its state), those being replaced too
    restarts: int
    slo: Mapping[str, Any]  # SloPolicy.stats()
    prefetch: Mapping[str, Any]  # Prefetcher.stats()
    pipelines: Mapping[tuple[str, str, str], int]  # requests by (pipeline, version tag, outcome)
    failed: frozenset[str] = frozenset()  # components failed: their replicas crash at every start
