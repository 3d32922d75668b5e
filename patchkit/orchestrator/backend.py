"""The interface every backend implements, and the replica handle the front-end dispatches to."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from patchkit.component import Call, Component
from patchkit.orchestrator.execute import Outcome
from patchkit.orchestrator.handles import Handles
from patchkit.orchestrator.resources import SHARES_PER_CORE, ReplicaResources

__all__ = ["DEAD", "SERVING", "STUCK", "UNHEALTHY", "Backend", "Channel", "Replica", "ReplicaSpec"]


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica to start: which component (by its pipeline name), with which resources.

    `device` and `units`: the resource type ("cpu" or "gpu") and the units of it a plan gave each
    replica (shares of a core, SHARES_PER_CORE a core, or GPUs), which a cluster backend asks its
    scheduler for; `device` None: no plan placed it.
    """

    component: str
    instance: Component  # travels as its spec; the inprocess backend runs this very object
    resources: ReplicaResources = field(default_factory=ReplicaResources)
    device: str | None = None
    units: int = SHARES_PER_CORE
    handles: Handles | None = None  # how its component reaches the components it holds that are deployed on their own


class Channel(Protocol):
    """How the front-end sends batches to one replica; `lost` is set once the replica is gone."""

    lost: asyncio.Event
    lost_reason: str

    async def run_batch(
        self,
        method: str,
        calls: Sequence[Call],
        expires_in: Sequence[float | None] | None = None,
        on_chunk: Sequence[Callable[[str], None] | None] | None = None,
        ended: Sequence[asyncio.Future[Any]] | None = None,
        traces: Sequence[dict[str, str] | None] | None = None,
    ) -> list[Outcome]:
        """Run a batch there: an outcome per call. `expires_in`: per call, the seconds its request has left;
        `on_chunk`: per call, where a streaming call's chunks go; `ended`: per call, a future cancelled
        when its request ends, which stops the call there; `traces`: per call, its span's context
        (patchkit.telemetry), which the replica's execution span continues (see `GrpcChannel.run_batch`)."""

    async def health(self, timeout_s: float) -> None:
        """Return if the replica answers within `timeout_s` and its component's `check_health()` passes; else raise."""

    async def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


# A replica's state (`Replica.state`): serving, or being recycled (stopped, another started in its place).
SERVING = "serving"
STUCK = "stuck"  # a batch ran past its call timeout, or what runs on it serves nobody
UNHEALTHY = "unhealthy"  # it failed `health_check_failures` health checks in a row
DEAD = "dead"  # its process or its stream ended


@dataclass(eq=False)
class Replica:
    """A running replica. `inflight` counts the batches the front-end has sent it and not had back.

    `state` is SERVING until the supervisor recycles it (STUCK, UNHEALTHY) or it dies (DEAD); `why`
    then says what happened. `failed_checks` counts its health checks failed in a row, `check_error`
    the last one's error.
    """

    id: str
    spec: ReplicaSpec
    channel: Channel
    pid: int | None = None
    address: str | None = None
    handle: Any = None  # the backend's own: a child process, an executor, an actor
    inflight: int = 0
    state: str = SERVING
    why: str = ""
    failed_checks: int = 0
    check_error: str = ""

    @property
    def component(self) -> str:
        return self.spec.component

    @property
    def alive(self) -> bool:
        return not self.channel.lost.is_set()

    @property
    def healthy(self) -> bool:
        """Alive, serving, and its last health check passed: what `/healthz` asks of one replica per component."""
        return self.alive and self.state == SERVING and self.failed_checks == 0

    def describe(self) -> dict[str, Any]:
        health = "ok" if not self.failed_checks else f"failing: {self.failed_checks} checks in a row ({self.check_error})"
        described = {
            "id": self.id,
            "pid": self.pid,
            "address": self.address,
            "alive": self.alive,
            "state": self.state,
            "health": health,
            "inflight_batches": self.inflight,
            "resources": self.spec.resources.describe(),
        }
        if self.why:
            described["why"] = self.why
        return described


class Backend(ABC):
    """Starts, stops and watches replicas. Called by the `Supervisor` on the front-end's event loop.

    `local` runs each replica as a worker subprocess, `inprocess` on a thread of this process; a
    cluster backend (Ray) places them elsewhere and reports their addresses the same way.
    """

    name: ClassVar[str]

    @abstractmethod
    async def start(self, spec: ReplicaSpec, replica_id: str) -> Replica:
        """Start a replica and return it once it takes calls; raise a PatchkitError if it cannot start."""

    @abstractmethod
    async def stop(self, replica: Replica) -> None:
        """Stop a replica for good; it is gone when this returns. Safe on one that already died."""

    @abstractmethod
    async def watch(self, replica: Replica) -> str:
        """Return, with the reason, once the replica has died or stopped."""

    @abstractmethod
    def replicas(self) -> list[Replica]:
        """The replicas this backend started and has not stopped, dead or alive."""

    def capacity(self) -> dict[str, int] | None:
        """Units per resource type ("cpu", "gpu") the replicas may share; None: this machine's.

        Read by the autoscaler once the replicas are up; a cluster backend answers for the cluster.
        """
        return None

    async def close(self) -> None:  # noqa: B027 - most backends hold nothing of their own
        """Release what the backend itself holds; the supervisor has stopped every replica by then."""
