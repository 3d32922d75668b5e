"""Rolling updates: a changed component whose new version has no room beside the old one is replaced a few
replicas at a time, within the room there is, as Ray Serve's rolling update does.

An update starts a changed component's new replicas beside the old ones when the backend says that the
resources free now hold them (`Backend.room`: on Ray, `ray.available_resources()`). Where they do not, and
no version that keeps serving calls the old component, `Deployment.add` starts the new one with no replica
and a `RollingUpdate` swaps them in, one at a time: an old replica retired (its batches in flight come back
first, the calls waiting for it go to its siblings or wait in the queue), then a new one started in its
place. Each request still runs wholly on one version:

- An old component with two replicas or more: one is swapped before the switch, so a failure then starts the
  old one again and the update changes nothing. After the switch (`finish`, in the background), the others
  follow one at a time, the last one kept for the requests still on the old version until they have ended.
- An old component with one replica: the switch comes first, and the new version's requests are held, none
  of their code run (`RequestRunner.hold`); once the requests on the old version have ended (within the drain
  timeout), the old replica is swapped (`after_switch`), and the requests held run on the new version. A
  failure then starts the old replica again and the front-end switches back; the requests held run on the
  old version, and none is lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

from patchkit.orchestrator.backend import ReplicaSpec
from patchkit.serving.deployment import Deployment

__all__ = ["RollingUpdate"]

logger = logging.getLogger(__name__)

WAIT_POLL_S = 0.05  # how often the end of the roll checks whether the old component is gone


class RollingUpdate:
    """The swaps of one update: `rolls` maps each new component (started with no replica) to the old one whose
    replicas it takes over. Driven by the front-end's update, on its event loop."""

    def __init__(self, deployment: Deployment, rolls: Mapping[str, str]) -> None:
        self.deployment = deployment
        self.rolls = dict(rolls)
        self.swapped: list[ReplicaSpec] = []  # the old replicas swapped out, until the update is done (`undo`)

    def gap(self) -> list[str]:
        """The new components whose old one runs a single replica: swapped only after the switch."""
        return [new for new, old in self.rolls.items() if len(self.deployment.supervisor.replicas(old)) < 2]

    async def before_switch(self) -> None:
        """Swap one replica of each old component that has two or more. Raises the first start error (then `undo`
        starts the old replicas swapped out again)."""
        gap = self.gap()
        for new, old in self.rolls.items():
            if new not in gap:
                await self.swap(old, new)

    async def after_switch(self) -> None:
        """Swap the single replica of each old component that has one; called once the requests on the old
        version have ended. Raises the first start error (then `undo` starts the old replicas again)."""
        for new in self.gap():
            await self.swap(self.rolls[new], new)

    async def swap(self, old: str, new: str) -> None:
        """Retire one replica of `old` (its batches in flight back first), then start one of `new` in its place;
        `new` serves from then on. Raises the start's error (the old replica's spec kept in `swapped`)."""
        supervisor = self.deployment.supervisor
        replicas = supervisor.replicas(old)
        if replicas:
            self.swapped.append(replicas[-1].spec)
            if len(replicas) == 1:  # its last: no version calls it any more, and /readyz asks nothing of it
                self.deployment.retiring.add(old)
            stopped = supervisor.retire(replicas[-1])
            if stopped is not None:
                await stopped
        await supervisor.add(self.deployment.one_more(new))
        self.deployment.starting.discard(new)
        logger.info("rolling update: a replica of %s serves in place of one of %s", new, old)

    async def undo(self) -> None:
        """Start again every old replica this update swapped out; called when the update is rolled back."""
        swapped, self.swapped = self.swapped, []
        for spec in swapped:
            if spec.component in self.deployment.components:
                logger.warning("rolling back: starting a replica of %s again", spec.component)
                await self.deployment.supervisor.add(spec)
            self.deployment.retiring.discard(spec.component)
        self.deployment.starting.difference_update(self.rolls)

    async def finish(self) -> None:
        """After the switch: bring each new component to its replica count, swapping the old one's replicas but
        its last one, then, once the old component is gone (no version calls it any more), starting the rest.
        A replica that cannot start is logged, and the component serves with those that did."""
        self.swapped = []  # the update is done: the old replicas swapped out stay out
        for new, old in self.rolls.items():
            try:
                await self._fill(new, old)
            except Exception as exc:
                have = len(self.deployment.supervisor.replicas(new))
                logger.error("rolling update: %s serves with %d of its %d replicas; one more could not start: %s", new,
                             have, self._target(new), exc)

    async def _fill(self, new: str, old: str) -> None:
        supervisor = self.deployment.supervisor
        while new in self.deployment.components and len(supervisor.replicas(new)) < self._target(new):
            if len(supervisor.replicas(old)) >= 2:
                await self.swap(old, new)
            elif old in self.deployment.components:
                await asyncio.sleep(WAIT_POLL_S)  # its last replica serves the old version's requests until they end
            else:
                await supervisor.add(self.deployment.one_more(new))

    def _target(self, name: str) -> int:
        settings = self.deployment.config.components.get(name)
        return 0 if settings is None else settings.replicas
