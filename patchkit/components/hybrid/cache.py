"""Which clusters should be resident: the hot-cluster policy (HedraRAG) and the lookahead set (TeleRAG).

`ClusterHeat` keeps a decayed access count per cluster; its hottest clusters that fit the cache
share of the budget stay resident. `Lookahead` remembers the clusters `prefetch` asked for, newest
first, within the rest of the budget, until they are used or expire. `desired` combines the two
into the list the device tier installs. Pure bookkeeping: no torch, no threads.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["ClusterHeat", "Lookahead", "desired", "fill"]

Array = np.ndarray[Any, Any]


class ClusterHeat:
    """Decayed access counts: each batch multiplies every count by `decay`, then adds its probes."""

    def __init__(self, nlist: int, *, decay: float) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1]; got {decay}")
        self.counts = np.zeros(nlist, dtype=np.float64)
        self.decay = decay

    def observe(self, probes: Array) -> None:
        """Count one batch's probed clusters ([B, nprobe] ids, -1 ignored); called by every search."""
        self.counts *= self.decay
        probed = probes[probes >= 0]
        np.add.at(self.counts, probed, 1.0)

    def ranking(self) -> Array:
        """Clusters hottest first; clusters never probed are left out."""
        order = np.argsort(-self.counts, kind="stable")
        return order[self.counts[order] > 0]


def fill(order: Iterable[int], cluster_bytes: Array, budget: int) -> list[int]:
    """The clusters of `order` that fit `budget` bytes, taken in order (a cluster too large is skipped)."""
    chosen, used = [], 0
    for c in order:
        size = int(cluster_bytes[c])
        if size and used + size <= budget:
            chosen.append(int(c))
            used += size
    return chosen


@dataclass
class _Pending:
    at: float  # when prefetch asked for the cluster
    used: bool = False


class Lookahead:
    """Clusters asked for by `prefetch`, newest first, kept until `ttl_s` after the request (or evicted)."""

    def __init__(self, *, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.clock = clock
        self.pending: OrderedDict[int, _Pending] = OrderedDict()

    def add(self, clusters: Iterable[int]) -> None:
        now = self.clock()
        for c in clusters:
            self.pending.pop(int(c), None)
            self.pending[int(c)] = _Pending(now)

    def expire(self) -> None:
        cutoff = self.clock() - self.ttl_s
        for c in [c for c, p in self.pending.items() if p.at < cutoff]:
            del self.pending[c]

    def newest_first(self) -> list[int]:
        return list(reversed(self.pending))

    def first_use(self, clusters: Iterable[int]) -> list[tuple[int, float]]:
        """Mark prefetched clusters a search used; returns (cluster, seconds since its prefetch) for each first use."""
        now, used = self.clock(), []
        for c in clusters:
            entry = self.pending.get(int(c))
            if entry is not None and not entry.used:
                entry.used = True
                used.append((int(c), now - entry.at))
        return used


def desired(hot: list[int], lookahead: list[int], cluster_bytes: Array, *, cache_bytes: int, total_bytes: int) -> list[int]:
    """What the device should hold: the hot clusters within the cache share, then lookahead ones in the rest."""
    chosen = fill(hot, cluster_bytes, cache_bytes)
    used = int(sum(int(cluster_bytes[c]) for c in chosen))
    taken = set(chosen)
    chosen += fill((c for c in lookahead if c not in taken), cluster_bytes, total_bytes - used)
    return chosen
