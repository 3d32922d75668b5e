"""Keeps every component at its replica count: starts replicas, watches them, restarts the dead.

Owned by the front-end, on its event loop. The front-end hears of replicas through two callbacks:
`on_up(replica)` once one takes calls, `on_down(replica, reason)` once one is gone (its in-flight
batches have failed with WorkerDiedError by then, and the front-end retries them elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections import defaultdict
from collections.abc import Callable

from patchkit.orchestrator.backend import Backend, Replica, ReplicaSpec

__all__ = ["Supervisor"]

logger = logging.getLogger(__name__)

RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


class Supervisor:
    def __init__(self, backend: Backend, on_up: Callable[[Replica], None], on_down: Callable[[Replica, str], None]) -> None:
        self.backend = backend
        self._on_up = on_up
        self._on_down = on_down
        self._numbers: dict[str, itertools.count[int]] = defaultdict(itertools.count)
        self._keepers: dict[Replica, asyncio.Task[None]] = {}  # watching a live replica: safe to cancel
        self._restarting: set[asyncio.Task[None]] = set()  # may be spawning a process: awaited, not cancelled
        self._closing = asyncio.Event()
        self.restarts = 0

    def replicas(self, component: str | None = None) -> list[Replica]:
        return [r for r in self._keepers if component is None or r.component == component]

    async def start(self, specs: list[ReplicaSpec]) -> None:
        """Start every replica concurrently; if one cannot start, stop the others and raise its error."""
        results = await asyncio.gather(*(self._start(spec) for spec in specs), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.close()
            raise errors[0]

    async def _start(self, spec: ReplicaSpec) -> Replica:
        replica_id = f"{spec.component}#{next(self._numbers[spec.component])}"
        replica = await self.backend.start(spec, replica_id)
        if self._closing.is_set():
            await self.backend.stop(replica)
            raise asyncio.CancelledError
        self._keepers[replica] = asyncio.get_running_loop().create_task(self._keep(replica))
        self._on_up(replica)
        return replica

    async def _keep(self, replica: Replica) -> None:
        reason = await self.backend.watch(replica)
        if self._closing.is_set() or self._keepers.pop(replica, None) is None:
            return
        logger.warning("replica %s died (%s); restarting it", replica.id, reason)
        self._on_down(replica, reason)
        task = asyncio.get_running_loop().create_task(self._restart(replica))
        self._restarting.add(task)
        task.add_done_callback(self._restarting.discard)

    async def _restart(self, dead: Replica) -> None:
        await self.backend.stop(dead)
        for attempt in itertools.count():
            backoff = RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)]
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), backoff)
            if self._closing.is_set():
                return
            try:
                await self._start(dead.spec)
            except asyncio.CancelledError:
                return
            except Exception as exc:
                logger.error("restarting a replica of %s failed (attempt %d): %s", dead.component, attempt + 1, exc)
            else:
                self.restarts += 1
                return

    async def close(self) -> None:
        """Stop every replica; nothing is restarted after this is called."""
        self._closing.set()
        await asyncio.gather(*self._restarting, return_exceptions=True)
        keepers, self._keepers = self._keepers, {}
        for keeper in keepers.values():
            keeper.cancel()
        for keeper in keepers.values():
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        await asyncio.gather(*(self.backend.stop(r) for r in keepers), return_exceptions=True)
        await self.backend.close()
