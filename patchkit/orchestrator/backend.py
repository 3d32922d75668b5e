"""The interface every backend implements, and the replica handle the front-end dispatches to."""

from __future__ import annotations

import asyncio
import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from patchkit.core import Component
from patchkit.crashes import NATIVE_CRASH_SIGNALS, signal_name
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.execute import Outcome
from patchkit.orchestrator.handles import Handles
from patchkit.orchestrator.resources import SHARES_PER_CORE, ReplicaResources, assign, cpu_threads, one_more, spread

__all__ = ["Backend", "Channel", "Replica", "ReplicaSpec", "ReplicaState"]


@dataclass(frozen=True)
class ReplicaSpec:
    """One replica to start: which component (by its pipeline name), with which resources.

    `device` and `units`: the resource type ("cpu" or "gpu") and the units of it a plan gave each
    replica (shares of a core, SHARES_PER_CORE a core, or GPUs), which a cluster backend asks its
    scheduler for; `device` None: no plan placed it. `batch_sizes`: each `@make` method's batch size
    there (of a `max_concurrency` method, its calls at once), which the replica's component is told
    before its setup (`Component.serve_sizes`).
    """

    component: str
    instance: Component  # travels as its spec; the inprocess backend runs this very object
    resources: ReplicaResources = field(default_factory=ReplicaResources)
    device: str | None = None
    units: int = SHARES_PER_CORE
    handles: Handles | None = None  # how its component reaches the components it holds that are deployed on their own
    batch_sizes: dict[str, int] | None = None  # what its component's `serve_sizes` is told (None: not called)


class Channel(Protocol):
    """How the front-end sends batches to one replica; `lost` is set once the replica is gone."""

    lost: asyncio.Event
    lost_reason: str

    async def run_batch(self, method: str, calls: Sequence[CallEnvelope]) -> list[Outcome]:
        """Run a batch there: an outcome per call, in order. Each call's envelope says until when it may
        start, where its chunks go, what stops it, and its trace (see `CallEnvelope`)."""

    async def health(self, timeout_s: float) -> None:
        """Return if the replica answers within `timeout_s` and its component's `check_health()` passes; else raise."""

    async def stats(self) -> dict[str, Any]: ...

    async def close(self) -> None: ...


class ReplicaState(enum.Enum):
    """Where a replica is in its life: serving, or out of service until another replaces it.

    Written by the `Supervisor` alone, which keeps every component at its replica count; the queues
    read it and report what they see (`Supervisor.mark_stuck`)."""

    SERVING = "serving"
    STUCK = "stuck"  # a batch ran past its call timeout, or what runs on it serves nobody
    UNHEALTHY = "unhealthy"  # it failed `health_check_failures` health checks in a row
    DEAD = "dead"  # its process or its stream ended


def signal_death(pid: int | None, code: int | None) -> tuple[str | None, str]:
    """The signal that ended a worker process with exit `code` (a negative code, as `subprocess` gives it),
    and how the supervisor's log and the errors say it: "worker pid 7 was killed by SIGSEGV, a crash in
    native code" (None and its exit code where no signal ended it)."""
    if code is None or code >= 0:
        return None, f"worker pid {pid} exited with code {code}"
    name = signal_name(-code)
    if name in NATIVE_CRASH_SIGNALS:
        return name, f"worker pid {pid} was killed by {name}, a crash in native code"
    return name, f"worker pid {pid} was killed by {name}"


@dataclass(eq=False)
class Replica:
    """A running replica. `inflight` counts the batches the front-end has sent it and not had back
    (kept by the component's `ReplicaSet`, which sends them).

    `state` is SERVING until the supervisor recycles it (STUCK, UNHEALTHY) or it dies (DEAD); `why`
    then says what happened. Both are the supervisor's to write, and `gone` is set once it has. `failed_checks`
    counts its health checks failed in a row, `check_error` the last one's error. `signal`: the signal that
    killed its process ("SIGSEGV"), where its backend saw one (a crash in native code). `served`: the
    batches it sent back in which its component ran a call.
    """

    id: str
    spec: ReplicaSpec
    channel: Channel
    pid: int | None = None
    address: str | None = None
    handle: Any = None  # the backend's own: a child process, an executor, an actor
    inflight: int = 0
    state: ReplicaState = ReplicaState.SERVING
    why: str = ""
    failed_checks: int = 0
    check_error: str = ""
    signal: str | None = None
    served: int = 0
    gone: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def component(self) -> str:
        return self.spec.component

    @property
    def alive(self) -> bool:
        return not self.channel.lost.is_set()

    @property
    def healthy(self) -> bool:
        """Alive, serving, and its last health check passed: what `/healthz` asks of one replica per component."""
        return self.alive and self.state is ReplicaState.SERVING and self.failed_checks == 0

    def describe(self) -> dict[str, Any]:
        health = "ok" if not self.failed_checks else f"failing: {self.failed_checks} checks in a row ({self.check_error})"
        described = {
            "id": self.id,
            "pid": self.pid,
            "address": self.address,
            "alive": self.alive,
            "state": self.state.value,
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
    # Whether a replica's component reaches the deployed components it holds through the front-end
    # (a worker process calling back over gRPC); else it runs them in place (a Ray actor, the user's objects).
    calls_held_through_frontend: ClassVar[bool] = False

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

    def place(self, placed: Sequence[tuple[str, int]], planned: bool) -> list[ReplicaResources]:
        """Each replica's pinning, in order, for replicas taking `placed` (their resource type, "cpu" or
        "gpu", and units of it): on the cores and GPUs a plan gave them when `planned`, else the machine
        shared evenly. Called by the deployment once, for the replicas it starts."""
        return assign(list(placed)) if planned else spread(len(placed))

    def place_one(self, resource: str, units: int, planned: bool, running: Sequence[Replica]) -> ReplicaResources:
        """The pinning of one more replica (the autoscaler's), beside the `running` ones: placed like its
        siblings on the plan's resource type, or, placed by nobody, seeing this process's GPUs as they do."""
        if not planned:
            return ReplicaResources(threads=cpu_threads(units) if resource == "cpu" else 1)
        held = {gpu for replica in running for gpu in (replica.spec.resources.gpus or ())}
        return one_more(resource, units, held)

    def room(self, specs: Sequence[ReplicaSpec]) -> bool:
        """Whether the resources free now hold replicas `specs` beside those running; asked by the deployment
        before an update starts the new version of a changed component beside the old one. The backends of
        this machine share it among however many replicas run: always True."""
        return True

    def capacity(self) -> dict[str, int] | None:
        """Units per resource type ("cpu", "gpu") the replicas may share; None: this machine's.

        Read by the autoscaler once the replicas are up; a cluster backend answers for the cluster.
        """
        return None

    async def close(self) -> None:  # noqa: B027 - most backends hold nothing of their own
        """Release what the backend itself holds; the supervisor has stopped every replica by then."""
