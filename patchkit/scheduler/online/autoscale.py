"""Autoscaling, the third SLO policy (Patchwork section 3.4): while requests stay at risk of missing
their SLO and resources are free, one more replica for the bottleneck component; a component idle
past a cool-down loses a replica; every component stays within its min/max replicas.

`Deployment.start` starts `Autoscaler.run` when the deployment's `autoscale` is on; it calls `step`
every `autoscale_interval_s`. `step(now)` decides from live state (the SLO policy's at-risk set,
the queues, the replicas, the applied plan) and applies its decisions through the supervisor,
which adds a replica with no downtime and retires one with no failed call (`Supervisor.add`,
`Supervisor.retire`). Tests call `step` directly, on their own clock.

The bottleneck is the component whose queued calls would take longest to drain: pending calls /
(live replicas x calls/s per replica), the rate from the plan's model when one is applied, else as
measured over the queues' throughput window. Where that cannot tell (nothing queued, or nothing
measured yet), the longest mean queue wait decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from patchkit.orchestrator.resources import SHARES_PER_CORE, available_cpus, available_gpus

if TYPE_CHECKING:
    from patchkit.config import DeploymentConfig
    from patchkit.orchestrator.backend import ReplicaSpec
    from patchkit.orchestrator.supervisor import Supervisor
    from patchkit.scheduler.online.replicas import ReplicaSet
    from patchkit.scheduler.online.slo import SloPolicy

__all__ = ["Autoscaler", "Decision"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """One replica more or less for a component, with the reason logged and returned by `step`."""

    kind: str  # "scale_up" | "scale_down"
    component: str
    replicas: int  # the component's replicas once it is applied
    reason: str


class Autoscaler:
    """Owned by the front-end's deployment, on its event loop, and given what it reads and drives of it:
    the config, the SLO policy (is anyone at risk?), the replica sets of the components (their queues
    and replicas), the supervisor that adds and retires replicas, and `one_more(name)`, the spec of a
    replica to add to a component (placed by the backend). `capacity`: units per resource type
    ("cpu", "gpu") replicas may take; None until first needed, then the applied plan's, else the
    backend's (a cluster's) or this machine's cores and GPUs."""

    def __init__(
        self,
        config: DeploymentConfig,
        policy: SloPolicy,
        supervisor: Supervisor,
        sets: Mapping[str, ReplicaSet],
        one_more: Callable[[str], ReplicaSpec],
        *,
        clock: Callable[[], float],
        capacity: Mapping[str, int] | None = None,
    ) -> None:
        self.config, self.policy, self.supervisor = config, policy, supervisor
        self.sets, self.one_more, self.clock = sets, one_more, clock
        self.capacity = dict(capacity) if capacity is not None else None
        self.replicas = {name: c.replicas for name, c in self.config.components.items()}  # as kept, restarts included
        started = clock()
        self._quiet_since = dict.fromkeys(self.replicas, started)  # lower bound of each component's idle time
        self._risk_since: float | None = None  # since when steps have seen requests at risk (reset by a scale-up)
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- the loop -------------------------------------------------------------------------------
    def start(self) -> None:
        """Called by `Deployment.start` once every replica is up, when the config's `autoscale` is on."""
        self._task = asyncio.get_running_loop().create_task(self.run())

    async def run(self) -> None:
        """A `step` every `autoscale_interval_s` until `close`; a step that fails is logged and the loop goes on."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.config.autoscaling.autoscale_interval_s)
            if self._stopping.is_set():
                return
            try:
                await self.step(self.clock())
            except Exception:
                logger.exception("an autoscaling step failed")

    async def close(self) -> None:
        """Called by `Deployment.stop_scaling` before the supervisor closes: waits for a step under way to end."""
        self._stopping.set()
        if self._task is not None:
            await self._task

    # -- decisions ------------------------------------------------------------------------------
    async def step(self, now: float) -> list[Decision]:
        """Decide (`decide`), then apply through the supervisor; returns the decisions applied."""
        applied = []
        for decision in self.decide(now):
            if await self._apply(decision, now):
                applied.append(decision)
        return applied

    def decide(self, now: float) -> list[Decision]:
        """At most one scale-up and one scale-down, from the state at `now`; changes nothing but the
        record of how long requests have been at risk. That is sampled here: requests count as at
        risk continuously while every step has seen some, so that admission pausing, which lets new
        requests in the moment none is at risk, does not restart the count at every turn."""
        if not self.policy.under_pressure():
            self._risk_since = None
        elif self._risk_since is None:
            self._risk_since = now
        return [d for d in (self._scale_up(now), self._scale_down(now)) if d is not None]

    def _scale_up(self, now: float) -> Decision | None:
        if self._risk_since is None or now - self._risk_since < self.config.autoscaling.scale_up_after_s:
            return None
        name, drain_s = self.bottleneck(now)
        replicas, most = self.replicas[name], self.config.max_replicas_of(name)
        if most is not None and replicas >= most:
            logger.debug("requests are at risk, but %s (the bottleneck) is at its max_replicas (%d)", name, most)
            return None
        kind, units = self.config.components[name].resource, self.config.components[name].units
        free = self.capacity_of(kind) - self.used(kind)
        if free < units:
            logger.debug("requests are at risk, but no %s unit is free for another replica of %s", kind, name)
            return None
        reason = (f"{self.policy.pressed()} requests at risk or beyond saving for {now - self._risk_since:.1f} s; {name} is "
                  f"the bottleneck (its queues drain in {drain_s:.2f} s); {free} {kind} units free")
        return Decision("scale_up", name, replicas + 1, reason)

    def _scale_down(self, now: float) -> Decision | None:
        for name, replicas in self.replicas.items():
            idle_s, after_s = self.idle_s(name, now), self.config.autoscaling.scale_down_after_s
            if replicas > self.config.min_replicas_of(name) and idle_s is not None and idle_s >= after_s:
                reason = f"no call queued or in flight for {idle_s:.1f} s (scale_down_after_s={after_s:g})"
                return Decision("scale_down", name, replicas - 1, reason)
        return None

    # -- applying -------------------------------------------------------------------------------
    async def _apply(self, decision: Decision, now: float) -> bool:
        """Apply one decision. A retired replica leaves dispatch at once, so a scale-down is recorded
        then, as stats show it, and only after that does the step wait for the replica to stop."""
        name, stopped = decision.component, None
        if decision.kind == "scale_up":
            changed = await self._add(name, now)
        else:
            changed, stopped = self._retire(name)
        if changed is None:
            return False
        self.replicas[name] = decision.replicas
        self.policy.record_scaling(decision.kind)
        logger.info("scaled %s %s to %d replicas (%s): %s", decision.kind.removeprefix("scale_"), name, decision.replicas,
                    changed, decision.reason)
        if stopped is not None:
            await stopped
        return True

    async def _add(self, name: str, now: float) -> str | None:
        """Start one more replica; its id, or None when it could not start (logged)."""
        self._risk_since = now  # the new replica gets scale_up_after_s to help before the next; so does a retry
        try:
            replica = await self.supervisor.add(self.one_more(name))
        except Exception as exc:
            logger.error("could not add a replica of %s: %s", name, exc)
            return None
        self._quiet_since[name] = now
        return replica.id

    def _retire(self, name: str) -> tuple[str | None, asyncio.Future[None] | None]:
        """Retire the least loaded live replica (of equals, the newest): its id and the future of its
        stop, or (None, None) when none was."""
        live = [r for r in self._set(name).replicas if r.alive]
        if len(live) < 2:  # the others are being restarted: wait for them
            return None, None
        replica = min(reversed(live), key=lambda r: r.inflight)
        stopped = self.supervisor.retire(replica)
        return (None, None) if stopped is None else (replica.id, stopped)

    # -- the model ------------------------------------------------------------------------------
    def bottleneck(self, now: float) -> tuple[str, float]:
        """The component whose queues would take longest to drain, and that time in seconds."""
        drains = {name: self.drain_s(name, now) for name in self.replicas}
        name = max(drains, key=lambda n: (drains[n], self.mean_wait_s(n)))
        return name, drains[name]

    def drain_s(self, name: str, now: float) -> float:
        """Seconds the component's live replicas need for its queued calls; inf when its rate is unknown."""
        pending = sum(len(queue) for queue in self._set(name).queues)
        if not pending:
            return 0.0
        rate = self.rate_per_replica(name, now)
        return pending / (self._live(name) * rate) if rate > 0 else math.inf

    def rate_per_replica(self, name: str, now: float) -> float:
        """Calls/s one replica serves: as the applied plan predicts, else as measured; 0.0 when unknown."""
        planned = (self.config.plan or {}).get("components", {}).get(name)
        if planned and planned.get("throughput"):
            return float(planned["throughput"]) / planned["replicas"]
        return sum(queue.stats.throughput(now) for queue in self._set(name).queues) / self._live(name)

    def mean_wait_s(self, name: str) -> float:
        queues = self._set(name).queues
        calls = sum(q.stats.calls for q in queues)
        return sum(q.stats.queue_wait_s for q in queues) / calls if calls else 0.0

    def idle_s(self, name: str, now: float) -> float | None:
        """Seconds since the component last had a call queued or in flight; None while it has one."""
        replica_set = self._set(name)
        if any(len(q) for q in replica_set.queues) or any(r.inflight for r in replica_set.replicas):
            return None
        done = [q.stats.last_done for q in replica_set.queues if q.stats.last_done is not None]
        return now - max([self._quiet_since[name], *done])

    def capacity_of(self, kind: str) -> int:
        """Units of `kind` there are: shares of the cores (SHARES_PER_CORE a core) on "cpu", GPUs on "gpu"."""
        if self.capacity is None:
            planned = (self.config.plan or {}).get("capacity")
            found = planned or self.supervisor.backend.capacity()  # a cluster backend's, else this machine's
            self.capacity = dict(found) if found else {"cpu": len(available_cpus()), "gpu": len(available_gpus())}
        return self.capacity.get(kind, 0) * (SHARES_PER_CORE if kind == "cpu" else 1)

    def used(self, kind: str) -> int:
        """Units of `kind` the replicas take: replicas x units, summed over the components placed on it."""
        return sum(self.replicas[n] * c.units for n, c in self.config.components.items() if c.resource == kind)

    def _set(self, name: str) -> ReplicaSet:
        return self.sets[name]

    def _live(self, name: str) -> int:
        return max(1, sum(r.alive for r in self._set(name).replicas))
