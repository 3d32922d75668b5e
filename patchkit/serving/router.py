"""Where a batch goes: the routing policy over a read-only view of one component's replicas.

Least loaded first: the replica with the fewest batches in flight, if it has room (`most` slots,
or only when idle for a batch that is not full). With a prefix key (the KV state a call reuses,
`Component.prefix_key`), the replica that last ran a call with that key, unless it is busier than the
least loaded by more than a quarter of its slots (cache-aware routing, as RAGCache routes to the
holder of a document's KV state). While that holder is full but no busier than that, the call waits
for it (`holder_full`) rather than evaluate its prefix again elsewhere.

The policy holds no replica state: it reads `alive` and `inflight` of the replicas it is shown, and
remembers only which replica last ran each prefix. Called by a `BatchQueue` as it dispatches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

__all__ = ["PREFIX_MEMORY", "ReplicaView", "Router"]

PREFIX_MEMORY = 4096  # prefix keys remembered per component


class ReplicaView(Protocol):
    """What routing reads of a replica."""

    @property
    def alive(self) -> bool: ...

    @property
    def inflight(self) -> int: ...


R = TypeVar("R", bound=ReplicaView)


class Router(Generic[R]):
    """The routing policy of one component. `max_inflight`: slots per replica unless a call says `most`."""

    def __init__(self, max_inflight: int, *, memory: int = PREFIX_MEMORY) -> None:
        self.max_inflight = max_inflight
        self.memory = memory
        self._holders: dict[str, R] = {}  # prefix key -> the replica that last ran it, least recent first
        self.prefix_hits = 0  # calls sent to the replica holding their prefix rather than the least loaded

    def least_loaded(self, replicas: Sequence[R], *, full: bool = True, most: int | None = None) -> R | None:
        """The alive replica with the fewest batches in flight, if one has fewer than `most` (default:
        `max_inflight`); unless the batch is `full`, only an idle replica will do."""
        best = None
        for replica in replicas:
            if self.has_room(replica, full, most) and (best is None or replica.inflight < best.inflight):
                best = replica
        return best

    def has_room(self, replica: R, full: bool = True, most: int | None = None) -> bool:
        """Alive, with fewer than `most` (default `max_inflight`) batches in flight; idle unless the batch is `full`."""
        return replica.alive and replica.inflight < ((most or self.max_inflight) if full else 1)

    def pick(
        self, replicas: Sequence[R], key: str | None, *, full: bool = True, most: int | None = None
    ) -> R | None:
        """Where a batch goes, and remember it for `key`: the holder of prefix `key` while it has room and is
        busier than the least loaded by at most a quarter of its slots; else the least loaded."""
        least = self.least_loaded(replicas, full=full, most=most)
        if least is None or key is None:
            return least
        held = self._near_holder(replicas, key, least, most)
        chosen = least
        if held is not None and self.has_room(held, full, most):
            chosen = held
            self.prefix_hits += 1
        self._holders.pop(key, None)
        self._holders[key] = chosen
        if len(self._holders) > self.memory:
            del self._holders[next(iter(self._holders))]
        return chosen

    def holder_full(self, replicas: Sequence[R], key: str | None, least: R, most: int | None = None) -> bool:
        """Whether the replica that last ran prefix `key` is full, but busier than `least` (the least
        loaded) by at most a quarter of its slots: a call with that key waits for it rather than go elsewhere."""
        held = self._near_holder(replicas, key, least, most) if key is not None else None
        return held is not None and not self.has_room(held, True, most)

    def _near_holder(
        self, replicas: Sequence[R], key: str, least: R, most: int | None
    ) -> R | None:
        """The alive replica (of `replicas`) that last ran prefix `key`, if it is busier than `least` by at
        most a quarter of its slots."""
        held = self._holders.get(key)
        slack = max(1, (most or self.max_inflight) // 4)
        if held is None or held not in replicas or not held.alive or held.inflight > least.inflight + slack:
            return None
        return held
