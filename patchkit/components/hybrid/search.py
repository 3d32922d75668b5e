"""`HybridSearch`: one search over the CPU IVF index and the device tier, merged exactly, plus the
background mover that keeps the device tier filled with hot and prefetched clusters.

Per batch: assign each query its nprobe clusters; split them into resident (the device searches
them) and missing (FAISS searches them on the CPU, the resident slots set to -1); both run at once
(FAISS releases the GIL); merge. Every `refresh_every` batches the mover installs the hottest
clusters in the background; `prefetch` adds the clusters nearest a query ahead of its search.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from patchkit.components.hybrid.cache import ClusterHeat, Lookahead, desired, fill
from patchkit.components.hybrid.device import DeviceTier, Residency
from patchkit.components.hybrid.index import IvfIndex
from patchkit.components.hybrid.merge import merge_topk

__all__ = ["HybridSearch", "SearchStats", "measure_bandwidth"]

logger = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]


@dataclass
class SearchStats:
    """Counters `stats()` reports; updated by searches and the mover under one lock."""

    batches: int = 0
    queries: int = 0
    probes: int = 0
    resident_probes: int = 0
    lookahead_probes: int = 0  # resident probes served by a cluster only prefetch made resident
    cpu_s: float = 0.0
    device_s: float = 0.0
    merge_s: float = 0.0
    refreshes: int = 0
    prefetches: int = 0
    bytes_copied: int = 0
    bytes_prefetched: int = 0
    bytes_prefetched_used: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def measure_bandwidth(device: str, nbytes: int = 16 << 20) -> float:
    """Host-to-device copy bandwidth in bytes/s (from pinned memory on CUDA), best of three copies."""
    import torch

    pin = torch.device(device).type == "cuda"
    host = torch.empty(nbytes // 4, dtype=torch.float32, pin_memory=pin).fill_(1.0)
    target = torch.empty_like(host, device=device)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        target.copy_(host, non_blocking=pin)
        if pin:
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return nbytes / max(best, 1e-9)


class HybridSearch:
    """The search engine behind `HybridIVFRetriever`, usable on its own over any IndexIVFFlat."""

    def __init__(
        self,
        index: IvfIndex,
        *,
        device: str,
        budget_bytes: int,
        cache_share: float = 0.75,
        refresh_every: int = 8,
        decay: float = 0.9,
        generation_s: float = 0.5,
        bandwidth_bps: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= cache_share <= 1:
            raise ValueError(f"cache_share must be in [0, 1]; got {cache_share}")
        if refresh_every < 1:
            raise ValueError(f"refresh_every must be >= 1; got {refresh_every}")
        if budget_bytes < 0:
            raise ValueError(f"the device budget must be >= 0 bytes; got {budget_bytes}")
        import torch

        self.index = index
        self.cluster_bytes = index.cluster_bytes()
        self.tier = DeviceTier(
            index.host_store(pin=torch.device(device).type == "cuda"), index.sizes,
            device=device, budget_bytes=budget_bytes, row_bytes=index.row_bytes, metric=index.metric,
        )
        self.cache_bytes = int(budget_bytes * cache_share)
        self.refresh_every = refresh_every
        self.heat = ClusterHeat(index.nlist, decay=decay)
        self.clock = clock
        # Expected time from a prefetch to the search that uses it (the generation in between),
        # re-measured from every first use of a prefetched cluster.
        self.generation_s = generation_s
        self.lookahead = Lookahead(ttl_s=max(4 * generation_s, 1.0), clock=clock)
        self.bandwidth_bps = bandwidth_bps if bandwidth_bps is not None else measure_bandwidth(device)
        self.stats = SearchStats()
        self._lock = threading.Lock()
        self._cpu = ThreadPoolExecutor(1, thread_name_prefix="patchkit-hybrid-cpu")
        self._mover = ThreadPoolExecutor(1, thread_name_prefix="patchkit-hybrid-mover")
        self._moving: Future[Residency] | None = None
        self._again = False  # a refresh was asked for while a move ran: run once more
        self._prefetched: set[int] = set()  # clusters resident only because prefetch asked for them

    # -- searching ------------------------------------------------------------------------------
    def search(self, queries: Array, k: int) -> tuple[Array, Array]:
        """Top-k (distances, ids) of each query, equal to the IVF index's own search at its nprobe.

        Called by the retriever for every batch. Never waits for the mover: it searches the
        residency published when it starts, and the CPU covers every cluster not in it.
        """
        if k < 1:
            raise ValueError(f"k must be >= 1; got {k}")
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2 or queries.shape[1] != self.index.dim:
            raise ValueError(f"queries must be [n, {self.index.dim}]; got shape {queries.shape}")
        residency = self.tier.current
        centroid_d, probes = self.index.assign(queries)
        resident = (probes >= 0) & residency.resident[np.where(probes >= 0, probes, 0)]
        missing = np.where(resident, -1, probes)
        on_device = np.where(resident, probes, -1)
        parts = []
        if (missing >= 0).any():
            cpu = self._cpu.submit(self._timed_cpu, queries, k, missing, centroid_d)
        else:
            cpu = None
        start = time.perf_counter()
        if resident.any():
            parts.append(self.tier.search(residency, queries, on_device, k))
        device_s = time.perf_counter() - start
        cpu_s = 0.0
        if cpu is not None:
            (d, i), cpu_s = cpu.result()
            parts.insert(0, (d, i))
        start = time.perf_counter()
        if parts:
            d, i = merge_topk(parts, k, larger_is_better=self.index.larger_is_better, worst=float(self.index.worst))
        else:  # nothing probed at all: FAISS's empty answer
            d = np.full((len(queries), k), self.index.worst, dtype=np.float32)
            i = np.full((len(queries), k), -1, dtype=np.int64)
        self._account(probes, resident, cpu_s, device_s, time.perf_counter() - start)
        return d, i

    def _timed_cpu(self, queries: Array, k: int, missing: Array, centroid_d: Array) -> tuple[tuple[Array, Array], float]:
        start = time.perf_counter()
        found = self.index.search_clusters(queries, k, missing, centroid_d)
        return found, time.perf_counter() - start

    def _account(self, probes: Array, resident: Array, cpu_s: float, device_s: float, merge_s: float) -> None:
        hit_clusters = np.unique(probes[resident])
        with self._lock:
            s = self.stats
            s.batches += 1
            s.queries += len(probes)
            s.probes += int((probes >= 0).sum())
            s.resident_probes += int(resident.sum())
            s.cpu_s, s.device_s, s.merge_s = s.cpu_s + cpu_s, s.device_s + device_s, s.merge_s + merge_s
            if self._prefetched:
                from_lookahead = [c for c in hit_clusters if int(c) in self._prefetched]
                if from_lookahead:
                    s.lookahead_probes += int(np.isin(probes[resident], from_lookahead).sum())
            for c, waited in self.lookahead.first_use(hit_clusters.tolist()):
                s.bytes_prefetched_used += int(self.cluster_bytes[c])
                self.generation_s = 0.8 * self.generation_s + 0.2 * waited
            self.heat.observe(probes)
            due = s.batches % self.refresh_every == 0
        if due:
            self.refresh()

    # -- moving clusters ------------------------------------------------------------------------
    def refresh(self) -> Future[Residency]:
        """Ask the mover to install the current hot and lookahead sets; returns the move's future.

        Never blocks. When a move is under way, it is marked to run once more before it finishes,
        so no request (a prefetch above all) is dropped.
        """
        with self._lock:
            if self._moving is not None and not self._moving.done():
                self._again = True
                return self._moving
            self._again = False
            self._moving = self._mover.submit(self._move_until_settled)
            return self._moving

    def _move_until_settled(self) -> Residency:
        while True:
            residency = self._move()
            with self._lock:
                if not self._again:
                    return residency
                self._again = False

    def _move(self) -> Residency:
        with self._lock:
            self.lookahead.expire()
            hot = self.heat.ranking().tolist()
            ahead = self.lookahead.newest_first()
            before = self.tier.current
            want = desired(hot, ahead, self.cluster_bytes, cache_bytes=self.cache_bytes, total_bytes=self.tier.budget_bytes)
        after = self.tier.install(want)
        if after is before:
            return after
        new = [c for c in after.clusters if not before.resident[c]]
        hot_set = set(fill(hot, self.cluster_bytes, self.cache_bytes))
        with self._lock:
            self.stats.refreshes += 1
            self.stats.bytes_copied += int(sum(int(self.cluster_bytes[c]) for c in new))
            self._prefetched = {c for c in after.clusters if c not in hot_set}
            self.stats.bytes_prefetched += int(sum(int(self.cluster_bytes[c]) for c in new if c in self._prefetched))
        logger.debug("device tier now holds %d clusters (%d new)", len(after.clusters), len(new))
        return after

    def prefetch_budget(self) -> int:
        """Bytes one prefetch may ask for: what the link copies during the expected generation time,
        within the lookahead share of the budget."""
        link = int(self.bandwidth_bps * self.generation_s)
        return max(0, min(link, self.tier.budget_bytes - self.cache_bytes))

    def prefetch(self, queries: Array) -> int:
        """Start copying the clusters nearest each query (nearest first, up to the prefetch budget) to
        the device, for a search expected soon. Called by the retriever's `prefetch`; returns the
        bytes asked for and never waits for the copy."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        _, probes = self.index.assign(queries)
        residency = self.tier.current
        budget, asked = self.prefetch_budget(), []
        per_query = max(1, budget // max(1, len(queries)))
        for row in probes:
            missing = [c for c in row.tolist() if c >= 0 and not residency.resident[c]]
            asked += fill(missing, self.cluster_bytes, per_query)
        with self._lock:
            self.stats.prefetches += 1
            self.lookahead.add(asked)
        if asked:
            self.refresh()
        return int(sum(int(self.cluster_bytes[c]) for c in asked))

    def wait_idle(self) -> None:
        """Block until the mover has nothing left to do (for tests and benchmarks that want a settled tier)."""
        with self._lock:
            moving = self._moving
        if moving is not None:
            moving.result()

    def report(self) -> dict[str, Any]:
        """Counters and the device tier's state, for the retriever's `stats()`."""
        with self._lock:
            s = self.stats
            residency = self.tier.current
            return {
                "device": str(self.tier.device),
                "budget_bytes": self.tier.budget_bytes,
                "resident_bytes": residency.nbytes,
                "resident_clusters": len(residency.clusters),
                "resident_share": residency.nbytes / max(1, int(self.cluster_bytes.sum())),
                "batches": s.batches,
                "queries": s.queries,
                "hit_rate": s.resident_probes / s.probes if s.probes else 0.0,
                "lookahead_hit_rate": s.lookahead_probes / s.probes if s.probes else 0.0,
                "cpu_search_s": s.cpu_s,
                "device_search_s": s.device_s,
                "merge_s": s.merge_s,
                "refreshes": s.refreshes,
                "prefetches": s.prefetches,
                "bytes_copied": s.bytes_copied,
                "bytes_prefetched": s.bytes_prefetched,
                "bytes_prefetched_used": s.bytes_prefetched_used,
                "link_bandwidth_bps": self.bandwidth_bps,
                "expected_generation_s": self.generation_s,
                "prefetch_budget_bytes": self.prefetch_budget(),
                **s.extra,
            }

    def close(self) -> None:
        """Stop the mover and the CPU thread (waiting for a move under way); called by the retriever."""
        self._mover.shutdown(wait=True, cancel_futures=True)
        self._cpu.shutdown(wait=True)
