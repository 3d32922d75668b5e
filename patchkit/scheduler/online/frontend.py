"""The front-end: one deployment of a captured pipeline, serving requests on one event loop.

Made of three parts, each in its own module: the `Deployment` (deployment.py: replica sets, queues,
supervisor, autoscaler, wired from the config and the plan), the `RequestRunner` (runner.py:
admission, the pipeline's code per request, its calls) and the `StatsCollector` (stats.py: counters
and the views of them). Built and driven by the front-end process (`patchkit.server`), which hands it
the backend the orchestrator built (`patchkit.orchestrator.backends.make_backend`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from patchkit.config import DeploymentConfig
from patchkit.orchestrator.backend import Backend
from patchkit.scheduler.online.deployment import Deployment
from patchkit.scheduler.online.runner import RequestResult, RequestRunner
from patchkit.scheduler.online.slo import SloPolicy, make_estimator
from patchkit.scheduler.online.stats import StatsCollector

if TYPE_CHECKING:
    from patchkit.client.pipeline import Pipeline  # the top layer: a type only

__all__ = ["Frontend", "Readiness", "RequestResult"]

logger = logging.getLogger(__name__)


class Frontend:
    """A pipeline deployed on `backend`: `start`, then `query` as requests come (`RequestRunner.query`),
    then `drain` and `close`; `stats`, `snapshot`, `healthy` and `replica_stats` are the `StatsCollector`'s,
    `readiness` says whether it takes requests now (`/readyz`).

    `clock`: what deadlines, queue waits and the SLO policies read; tests inject their own."""

    def __init__(
        self, pipeline: Pipeline, config: DeploymentConfig, backend: Backend, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.pipeline = pipeline
        self.config = config
        self.policy = SloPolicy(
            make_estimator(config.slo.estimator),
            prioritize=config.slo.prioritize,
            pause_admission=config.slo.pause_admission,
            admission_limit=config.slo.admission_queue_limit,
            clock=clock,
        )
        self.deployment = Deployment(pipeline, config, backend, self.policy, clock=clock)
        self.collector = StatsCollector(self.deployment, self.policy, lambda: self.runner.inflight)
        self.runner = RequestRunner(pipeline, config, self.deployment, self.policy, self.collector, clock=clock)
        # What the server calls, each answered by the part it belongs to.
        self.query = self.runner.query
        self.healthy = self.collector.healthy
        self.snapshot = self.collector.snapshot
        self.stats = self.collector.stats
        self.replica_stats = self.collector.replica_stats
        self.started = False  # every replica `start` started is up
        self._draining: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Start every replica (see `Deployment.start`); raises the first replica's start error."""
        await self.deployment.start()
        self.started = True

    def readiness(self) -> Readiness:
        """Whether the front-end takes requests now, and if not why; called by `/readyz`.

        "starting" until every replica `start` started is up, "draining" from `drain` on, "unready" while a
        replica is out of service (being replaced: its restart may be failing) or failing its health checks
        (`StatsCollector.not_ready`), else "ready"."""
        if not self.started:
            return Readiness("starting", ("the workers are starting",))
        if self.runner.closing:
            return Readiness("draining", ("the endpoint is shutting down",))
        reasons = self.collector.not_ready()
        return Readiness("unready" if reasons else "ready", tuple(reasons))

    async def drain(self) -> None:
        """Refuse new requests and stop the autoscaler, then wait for in-flight requests (up to the drain
        timeout); called first when the server stops, while it still answers (`/readyz`: "draining").
        A second call waits for the first one's drain."""
        if self._draining is None:
            self.runner.closing = True  # from now on: no request is admitted while the task below starts
            self._draining = asyncio.ensure_future(self._drain())
        await asyncio.shield(self._draining)

    async def _drain(self) -> None:
        await self.deployment.stop_scaling()
        if not await self.runner.drained(self.config.liveness.drain_timeout_s):
            logger.warning("closing with %d requests still in flight after %.0f s", self.runner.inflight,
                           self.config.liveness.drain_timeout_s)

    async def close(self) -> None:
        """`drain` (if not done yet), then stop every replica."""
        await self.drain()
        await self.deployment.close()


@dataclass(frozen=True)
class Readiness:
    """What `/readyz` answers: `status` ("ready", "starting", "draining" or "unready") and why it is not ready."""

    status: str
    reasons: tuple[str, ...] = ()

    @property
    def ready(self) -> bool:
        return self.status == "ready"
