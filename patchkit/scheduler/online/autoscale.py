"""Autoscaling's decisions, the third SLO policy (Patchwork section 3.4): while requests stay at risk
of missing their SLO and resources are free, one more replica for the bottleneck component; a
component idle past a cool-down loses a replica; every component stays within its min/max replicas.

`ScalingPolicy.decide(now)` decides from live state (the SLO policy's at-risk set, the components'
queues and replicas, the applied plan) and changes nothing outside itself. The serving side's
`Autoscaler` (patchkit/serving/scaling.py) holds one, applies its decisions through the supervisor
and reports back what it applied (`adding`, `applied`).

The bottleneck is the component whose queued calls would take longest to drain: pending calls /
(live replicas x calls/s per replica), the rate from the plan's model when one is applied, else as
measured over the queues' throughput window. Where that cannot tell (nothing queued, or nothing
measured yet), the longest mean queue wait decides.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from patchkit.orchestrator.resources import SHARES_PER_CORE, available_cpus, available_gpus

if TYPE_CHECKING:
    from patchkit.config import DeploymentConfig
    from patchkit.orchestrator.backend import Backend, Replica
    from patchkit.scheduler.online.slo import SloPolicy

__all__ = ["ComponentLoad", "Decision", "ScalingPolicy"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """One replica more or less for a component, with the reason logged and returned by `Autoscaler.step`."""

    kind: str  # "scale_up" | "scale_down"
    component: str
    replicas: int  # the component's replicas once it is applied
    reason: str


class _QueueStats(Protocol):
    @property
    def calls(self) -> int: ...
    @property
    def queue_wait_s(self) -> float: ...
    @property
    def last_done(self) -> float | None: ...
    def throughput(self, now: float) -> float: ...


class _Queue(Protocol):
    @property
    def stats(self) -> _QueueStats: ...
    def __len__(self) -> int: ...


class ComponentLoad(Protocol):
    """What the policy reads of a component's replica set: its queues (their lengths and stats) and replicas."""

    @property
    def queues(self) -> Sequence[_Queue]: ...
    @property
    def replicas(self) -> Sequence[Replica]: ...


class ScalingPolicy:
    """Held by the `Autoscaler`, on the front-end's event loop, and given what it reads: the config,
    the SLO policy (is anyone at risk?), the components' load (`sets`), the backend (its capacity)
    and `started`, when serving began. `capacity`: units per resource type ("cpu", "gpu") replicas
    may take; None until first needed, then the applied plan's, else the backend's (a cluster's) or
    this machine's cores and GPUs."""

    def __init__(
        self,
        config: DeploymentConfig,
        slo: SloPolicy,
        sets: Mapping[str, ComponentLoad],
        backend: Backend,
        *,
        started: float,
        capacity: Mapping[str, int] | None = None,
    ) -> None:
        self.config, self.slo, self.sets, self.backend = config, slo, sets, backend
        self.capacity = dict(capacity) if capacity is not None else None
        self.replicas = {name: c.replicas for name, c in self.config.components.items()}  # as kept, restarts included
        self._quiet_since = dict.fromkeys(self.replicas, started)  # lower bound of each component's idle time
        self._risk_since: float | None = None  # since when steps have seen requests at risk (reset by a scale-up)

    def track(self, names: list[str], now: float) -> None:
        """Components `names` were deployed (as the config sizes them) while the deployment serves: counted from now."""
        for name in names:
            self.replicas[name] = self.config.components[name].replicas
            self._quiet_since[name] = now

    def forget(self, names: list[str]) -> None:
        """Components `names` leave the deployment: they are scaled no more."""
        for name in names:
            self.replicas.pop(name, None)
            self._quiet_since.pop(name, None)

    # -- decisions ------------------------------------------------------------------------------
    def decide(self, now: float) -> list[Decision]:
        """At most one scale-up and one scale-down, from the state at `now`; changes nothing but the
        record of how long requests have been at risk. That is sampled here: requests count as at
        risk continuously while every step has seen some, so that admission pausing, which lets new
        requests in the moment none is at risk, does not restart the count at every turn."""
        if not self.slo.under_pressure():
            self._risk_since = None
        elif self._risk_since is None:
            self._risk_since = now
        return [d for d in (self._scale_up(now), self._scale_down(now)) if d is not None]

    def adding(self, now: float) -> None:
        """Called by the autoscaler as it starts a replica (a retry too): the new one gets
        scale_up_after_s to help before the next scale-up."""
        self._risk_since = now

    def applied(self, decision: Decision, now: float) -> None:
        """Called by the autoscaler once `decision` took effect: the component's replicas as kept, and
        an added replica's component counted quiet from `now`."""
        if decision.kind == "scale_up":
            self._quiet_since[decision.component] = now
        self.replicas[decision.component] = decision.replicas

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
        reason = (f"{self.slo.pressed()} requests at risk or beyond saving for {now - self._risk_since:.1f} s; {name} is "
                  f"the bottleneck (its queues drain in {drain_s:.2f} s); {free} {kind} units free")
        return Decision("scale_up", name, replicas + 1, reason)

    def _scale_down(self, now: float) -> Decision | None:
        for name, replicas in self.replicas.items():
            idle_s, after_s = self.idle_s(name, now), self.config.autoscaling.scale_down_after_s
            if replicas > self.config.min_replicas_of(name) and idle_s is not None and idle_s >= after_s:
                reason = f"no call queued or in flight for {idle_s:.1f} s (scale_down_after_s={after_s:g})"
                return Decision("scale_down", name, replicas - 1, reason)
        return None

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
            found = planned or self.backend.capacity()  # a cluster backend's, else this machine's
            self.capacity = dict(found) if found else {"cpu": len(available_cpus()), "gpu": len(available_gpus())}
        return self.capacity.get(kind, 0) * (SHARES_PER_CORE if kind == "cpu" else 1)

    def used(self, kind: str) -> int:
        """Units of `kind` the replicas take: replicas x units, summed over the components placed on it."""
        placed = {name: self.config.components[name] for name in self.replicas}  # the components deployed and scaled
        return sum(self.replicas[name] * c.units for name, c in placed.items() if c.resource == kind)

    def _set(self, name: str) -> ComponentLoad:
        return self.sets[name]

    def _live(self, name: str) -> int:
        return max(1, sum(r.alive for r in self._set(name).replicas))
