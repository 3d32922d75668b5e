"""The `local` backend: every replica is a worker subprocess on this machine, serving on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import threading

from patchkit import envs
from patchkit.orchestrator.backend import Backend, Replica, ReplicaSpec, ReplicaState, signal_death
from patchkit.orchestrator.process import Child, spawn
from patchkit.orchestrator.rpc import GrpcChannel
from patchkit.orchestrator.worker import WorkerBootstrap

__all__ = ["LocalBackend"]

EXIT_SEEN_S = 2.0  # once a worker's stream breaks, how long its process gets to be seen exiting (and how)


class LocalBackend(Backend):
    name = "local"
    calls_held_through_frontend = True

    def __init__(self, secret: str, host: str = "127.0.0.1") -> None:
        self._secret = secret
        self._host = host
        self._exits: dict[Replica, asyncio.Event] = {}

    async def start(self, spec: ReplicaSpec, replica_id: str) -> Replica:
        child = await asyncio.to_thread(self._spawn, spec, replica_id)  # pickling a large component too, off the loop
        address = f"{self._host}:{child.report['port']}"
        channel = GrpcChannel(address, self._secret)
        replica = Replica(replica_id, spec, channel, pid=child.pid, address=address, handle=child)
        self._exits[replica] = self._watch_exit(child)
        try:
            await channel.open()
        except Exception:
            await self.stop(replica)
            raise
        return replica

    def _spawn(self, spec: ReplicaSpec, replica_id: str) -> Child:
        boot = WorkerBootstrap.of(spec, self._secret, host=self._host)
        return spawn(
            "patchkit.orchestrator.worker",
            pickle.dumps(boot),
            what=f"worker {replica_id}",
            env=spec.resources.environment(),
            timeout_s=envs.worker_start_timeout_s(),
            own_group=True,  # what its component starts stops with it
        )

    def _watch_exit(self, child: Child) -> asyncio.Event:
        """An event set when the process exits; one waiting thread per worker (the default pool is small)."""
        loop, exited = asyncio.get_running_loop(), asyncio.Event()

        def wait() -> None:
            child.process.wait()
            try:
                loop.call_soon_threadsafe(exited.set)
            except RuntimeError:
                pass  # the loop closed first: nobody is watching any more

        threading.Thread(target=wait, name=f"patchkit-wait-{child.pid}", daemon=True).start()
        return exited

    async def stop(self, replica: Replica) -> None:
        """Stop the worker and its process group: given PATCHKIT_WORKER_STOP_TIMEOUT_S to exit, or
        killed at once when it is being recycled (stuck or unhealthy: it may never exit by itself)."""
        await replica.channel.close()
        child: Child = replica.handle
        grace = 0.0 if replica.state in (ReplicaState.STUCK, ReplicaState.UNHEALTHY) else envs.worker_stop_timeout_s()
        await asyncio.to_thread(child.stop, grace)
        self._exits.pop(replica, None)

    def replicas(self) -> list[Replica]:
        return list(self._exits)

    async def watch(self, replica: Replica) -> str:
        exited = self._exits.get(replica)
        if exited is None:
            return "stopped"
        waits = {asyncio.ensure_future(exited.wait()), asyncio.ensure_future(replica.channel.lost.wait())}
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waits:
                waiter.cancel()
        if not exited.is_set():  # its stream broke first, as it does when the process dies: its exit says how
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(exited.wait(), EXIT_SEEN_S)
        child: Child = replica.handle
        if not exited.is_set():
            return replica.channel.lost_reason
        replica.signal, reason = signal_death(child.pid, child.process.returncode)
        return reason
