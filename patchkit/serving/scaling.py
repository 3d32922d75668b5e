"""Autoscaling applied: the loop that asks the `ScalingPolicy` (patchkit/scheduler/online/autoscale.py)
what to scale and does it through the supervisor, which adds a replica with no downtime and retires
one with no failed call (`Supervisor.add`, `Supervisor.retire`).

`Deployment.start` starts `Autoscaler.run` when the deployment's `autoscale` is on; it calls `step`
every `autoscale_interval_s`. Tests call `step` directly, on their own clock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from patchkit.scheduler.online.autoscale import Decision, ScalingPolicy

if TYPE_CHECKING:
    from patchkit.config import DeploymentConfig
    from patchkit.orchestrator.backend import ReplicaSpec
    from patchkit.orchestrator.supervisor import Supervisor
    from patchkit.scheduler.online.slo import SloPolicy
    from patchkit.serving.replicas import ReplicaSet

__all__ = ["Autoscaler"]

logger = logging.getLogger(__name__)

RECENT_DECISIONS = 50


class Autoscaler:
    """Owned by the front-end's deployment, on its event loop, and given what it reads and drives of it:
    the config, the SLO policy (is anyone at risk?), the replica sets of the components (their queues
    and replicas), the supervisor that adds and retires replicas, and `one_more(name)`, the spec of a
    replica to add to a component (placed by the backend). `policy` is the `ScalingPolicy` that
    decides; `capacity` is its (see there)."""

    def __init__(
        self,
        config: DeploymentConfig,
        slo: SloPolicy,
        supervisor: Supervisor,
        sets: Mapping[str, ReplicaSet],
        one_more: Callable[[str], ReplicaSpec],
        *,
        clock: Callable[[], float],
        capacity: Mapping[str, int] | None = None,
    ) -> None:
        self.config, self.slo, self.supervisor = config, slo, supervisor
        self.sets, self.one_more, self.clock = sets, one_more, clock
        self.policy = ScalingPolicy(config, slo, sets, supervisor.backend, started=clock(), capacity=capacity)
        self._stopping = asyncio.Event()
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_DECISIONS)  # the decisions applied lately, for the dashboard
        self._task: asyncio.Task[None] | None = None

    # -- the loop -------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._task is not None

    def track(self, names: list[str]) -> None:
        """Scale components `names` too, deployed while the deployment serves (`ScalingPolicy.track`)."""
        self.policy.track(names, self.clock())

    def forget(self, names: list[str]) -> None:
        """Scale components `names` no more: they leave the deployment."""
        self.policy.forget(names)

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

    # -- applying -------------------------------------------------------------------------------
    async def step(self, now: float) -> list[Decision]:
        """Decide (`ScalingPolicy.decide`), then apply through the supervisor; returns the decisions applied."""
        applied = []
        for decision in self.policy.decide(now):
            if await self._apply(decision, now):
                applied.append(decision)
        return applied

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
        self.policy.applied(decision, now)
        self.slo.record_scaling(decision.kind)
        self.recent.append({"at": time.time(), "kind": decision.kind, "component": name, "replicas": decision.replicas,
                            "replica": changed, "reason": decision.reason})
        logger.info("scaled %s %s to %d replicas (%s): %s", decision.kind.removeprefix("scale_"), name, decision.replicas,
                    changed, decision.reason)
        if stopped is not None:
            await stopped
        return True

    async def _add(self, name: str, now: float) -> str | None:
        """Start one more replica; its id, or None when it could not start (logged)."""
        if name in self.supervisor.failed:  # nothing of it starts until an update revives it
            return None
        self.policy.adding(now)
        try:
            replica = await self.supervisor.add(self.one_more(name))
        except Exception as exc:
            logger.error("could not add a replica of %s: %s", name, exc)
            return None
        return replica.id

    def _retire(self, name: str) -> tuple[str | None, asyncio.Future[None] | None]:
        """Retire the least loaded live replica (of equals, the newest): its id and the future of its
        stop, or (None, None) when none was."""
        live = [r for r in self.sets[name].replicas if r.alive]
        if len(live) < 2:  # the others are being restarted: wait for them
            return None, None
        replica = min(reversed(live), key=lambda r: r.inflight)
        stopped = self.supervisor.retire(replica)
        return (None, None) if stopped is None else (replica.id, stopped)
