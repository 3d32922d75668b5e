"""The front-end: one deployment of a captured pipeline, serving requests on one event loop.

Made of three parts, each in its own module: the `Deployment` (deployment.py: replica sets, queues,
supervisor, autoscaler, wired from the config and the plan), the `RequestRunner` (runner.py:
admission, the pipeline's code per request, its calls) and the `StatsCollector` (stats.py: counters
and the views of them). Built and driven by the front-end process (`patchkit.server`), which hands it
the backend the orchestrator built (`patchkit.orchestrator.backends.make_backend`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from patchkit.config import DeploymentConfig
from patchkit.orchestrator.backend import Backend
from patchkit.scheduler.online.deployment import Deployment
from patchkit.scheduler.online.runner import RequestResult, RequestRunner
from patchkit.scheduler.online.slo import SloPolicy, make_estimator
from patchkit.scheduler.online.stats import StatsCollector

if TYPE_CHECKING:
    from patchkit.client.pipeline import Pipeline  # the top layer: a type only

__all__ = ["Frontend", "RequestResult"]

logger = logging.getLogger(__name__)


class Frontend:
    """A pipeline deployed on `backend`: `start`, then `query` as requests come (`RequestRunner.query`),
    then `close`; `stats`, `snapshot`, `healthy` and `replica_stats` are the `StatsCollector`'s.

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

    async def start(self) -> None:
        """Start every replica (see `Deployment.start`); raises the first replica's start error."""
        await self.deployment.start()

    async def close(self) -> None:
        """Refuse new requests and stop the autoscaler, wait for in-flight requests (up to the drain
        timeout), then stop every replica."""
        self.runner.closing = True
        await self.deployment.stop_scaling()
        if not await self.runner.drained(self.config.liveness.drain_timeout_s):
            logger.warning("closing with %d requests still in flight after %.0f s", self.runner.inflight,
                           self.config.liveness.drain_timeout_s)
        await self.deployment.close()
