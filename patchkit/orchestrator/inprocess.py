"""The `inprocess` backend: replicas are threads of this process running the user's own objects.

For unit tests and pdb: nothing is pickled, nothing is started, a breakpoint in a component stops
the whole deployment where it is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from patchkit.client.component import Call, Component, ensure_setup
from patchkit.errors import WorkerDiedError
from patchkit.orchestrator.backend import Backend, Replica, ReplicaSpec
from patchkit.orchestrator.execute import Outcome, run_batch, setup_error

__all__ = ["InProcessBackend"]


class DirectChannel:
    """Runs batches on a thread of its own, one at a time, as a worker process would."""

    def __init__(self, component: Component, name: str) -> None:
        self.component = component
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"patchkit-{name}")
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.batches = 0
        self.calls = 0

    async def run_batch(self, method: str, calls: Sequence[Call]) -> list[Outcome]:
        if self.lost.is_set():
            raise WorkerDiedError(f"inprocess replica is stopped: {self.lost_reason}")
        loop = asyncio.get_running_loop()
        outcomes = await loop.run_in_executor(self._executor, run_batch, self.component, method, calls)
        self.batches += 1
        self.calls += len(calls)
        return outcomes

    async def stats(self) -> dict[str, Any]:
        return {"batches": self.batches, "calls": self.calls}

    async def close(self) -> None:
        if not self.lost.is_set():
            self.lost_reason = "stopped"
            self.lost.set()
        self._executor.shutdown(wait=True)


class InProcessBackend(Backend):
    name = "inprocess"

    async def start(self, spec: ReplicaSpec, replica_id: str) -> Replica:
        channel = DirectChannel(spec.instance, replica_id)
        try:
            await asyncio.get_running_loop().run_in_executor(channel._executor, ensure_setup, spec.instance)
        except Exception as exc:
            await channel.close()
            raise setup_error(spec.component, exc) from None
        return Replica(replica_id, spec, channel)

    async def stop(self, replica: Replica) -> None:
        await replica.channel.close()

    async def watch(self, replica: Replica) -> str:
        await replica.channel.lost.wait()
        return replica.channel.lost_reason
