"""The `inprocess` backend: replicas run the user's own objects on the front-end's event loop.

For unit tests and pdb: nothing is pickled, no process is started, and a batch runs to completion
before the loop goes on, so runs are deterministic and a breakpoint in a component stops the whole
deployment where it is. (Batching and the pipeline's control flow are the same as on the process
backends; only components never overlap one another.) The one exception: a batch whose chunks a
streaming client waits for runs on a thread, so that the loop sends each chunk as it is made, as
a worker does; its replica runs no other batch meanwhile.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

from patchkit import telemetry
from patchkit.component import Component, ensure_setup
from patchkit.errors import WorkerDiedError
from patchkit.orchestrator.backend import Backend, Replica, ReplicaSpec
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.execute import Outcome, component_stats, run_calls, setup_error
from patchkit.orchestrator.resources import ReplicaResources

__all__ = ["InProcessBackend"]


class DirectChannel:
    """Runs each batch inline, on the calling event loop; a streamed one on a thread."""

    def __init__(self, component: Component, name: str) -> None:
        self.component = component
        self.name = name
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.batches = 0
        self.calls = 0
        self._running = asyncio.Lock()  # one batch at a time, as a worker runs them

    async def run_batch(self, method: str, calls: Sequence[CallEnvelope]) -> list[Outcome]:
        """Run the batch now, in an execution span per traced call, as a worker does; a streaming call's
        chunks handed to its `on_chunk` on this loop as they are made (`expires` does not apply: no call
        waits here). `ended` applies to a streamed batch only: a call whose request ended stops at its
        next chunk."""
        if self.lost.is_set():
            raise WorkerDiedError(f"inprocess replica is stopped: {self.lost_reason}")
        traces = [call.trace for call in calls] if any(call.trace is not None for call in calls) else None
        async with self._running:
            with telemetry.execution(self.name, method, traces):
                if all(call.on_chunk is None for call in calls):
                    outcomes = run_calls(self.component, method, [call.call for call in calls])
                else:
                    outcomes = await self._streamed(method, calls)
        self.batches += 1
        self.calls += len(calls)
        return outcomes

    async def _streamed(self, method: str, calls: Sequence[CallEnvelope]) -> list[Outcome]:
        """A batch whose chunks are wanted, on a thread: the loop sends each chunk while the next is made.
        Once the batch is given up on (its replica recycled) or a call's request ends, the call stops
        at its next chunk."""
        loop = asyncio.get_running_loop()
        stops = [threading.Event() for _ in calls]

        def sink(index: int, text: str) -> None:
            target = calls[index].on_chunk
            if target is not None:
                loop.call_soon_threadsafe(target, text)

        watched = [(call.ended, lambda future, stop=stop: future.cancelled() and stop.set())
                   for call, stop in zip(calls, stops) if call.ended is not None]
        for end, stop_on_end in watched:
            end.add_done_callback(stop_on_end)
        try:
            return await asyncio.to_thread(run_calls, self.component, method, [call.call for call in calls], sink, stops)
        except asyncio.CancelledError:
            for stop in stops:
                stop.set()
            raise
        finally:
            for end, stop_on_end in watched:
                end.remove_done_callback(stop_on_end)

    async def health(self, timeout_s: float) -> None:
        """The component's `check_health()`, run here on the loop."""
        self.component.check_health()

    async def stats(self) -> dict[str, Any]:
        return {"batches": self.batches, "calls": self.calls, "component_stats": component_stats(self.component)}

    async def close(self) -> None:
        if not self.lost.is_set():
            self.lost_reason = "stopped"
            self.lost.set()


class InProcessBackend(Backend):
    name = "inprocess"

    def place(self, placed: Sequence[tuple[str, int]], planned: bool) -> list[ReplicaResources]:
        """Nothing is pinned: every replica is an object of this process."""
        return [ReplicaResources() for _ in placed]

    def place_one(self, resource: str, units: int, planned: bool, running: Sequence[Replica]) -> ReplicaResources:
        return ReplicaResources()

    def __init__(self) -> None:
        self._started: list[Replica] = []

    async def start(self, spec: ReplicaSpec, replica_id: str) -> Replica:
        try:
            ensure_setup(spec.instance)
        except Exception as exc:
            raise setup_error(spec.component, exc) from None
        replica = Replica(replica_id, spec, DirectChannel(spec.instance, spec.component))
        self._started.append(replica)
        return replica

    async def stop(self, replica: Replica) -> None:
        await replica.channel.close()
        if replica in self._started:
            self._started.remove(replica)

    def replicas(self) -> list[Replica]:
        return list(self._started)

    async def watch(self, replica: Replica) -> str:
        await replica.channel.lost.wait()
        return replica.channel.lost_reason
