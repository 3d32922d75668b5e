"""A deployment's serving parts, wired from its config and plan: replica sets, queues, supervisor, autoscaler.

Built by the front-end (frontend.py) for one pipeline: one `ReplicaSet` per component, one
`BatchQueue` per (component, method) with the batch size the config (or its plan) gives it, the
`Supervisor` that starts the replicas the backend places, the `Autoscaler` and the `Prefetcher`.
The request runner submits each component call here (`submit`), as do the workers whose components
call the components they hold (`CallService`) and the prefetcher.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from patchkit.capture.holders import constructor_components
from patchkit.component import Component, make_methods
from patchkit.config import DeploymentConfig
from patchkit.errors import PatchkitError
from patchkit.orchestrator.backend import Backend, Replica, ReplicaSpec
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.execute import Failure, Outcome
from patchkit.orchestrator.handles import CallService, Handles
from patchkit.orchestrator.resources import ReplicaResources
from patchkit.orchestrator.supervisor import HealthChecks, Supervisor
from patchkit.scheduler.online.autoscale import Autoscaler
from patchkit.scheduler.online.prefetch import PREFETCH_METHOD, Prefetcher, find_routes
from patchkit.scheduler.online.queues import BatchQueue, PendingCall
from patchkit.scheduler.online.replicas import ReplicaSet
from patchkit.scheduler.online.slo import SloPolicy

if TYPE_CHECKING:
    from patchkit.client.pipeline import Pipeline  # the top layer: a type only

__all__ = ["Deployment"]

logger = logging.getLogger(__name__)


class Deployment:
    """The replicas and queues of every component of `pipeline`, on the backend the config chose.

    Lives on the front-end's event loop. `policy` is the request runner's SLO policy, which the
    autoscaler reads (are requests at risk?).
    """

    def __init__(
        self,
        pipeline: Pipeline,
        config: DeploymentConfig,
        backend: Backend,
        policy: SloPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.components: dict[str, Component] = pipeline.components
        self.names = {c._patchkit_spec.uid: name for name, c in self.components.items()}  # uid -> pipeline name
        self.aliases = pipeline.component_aliases()  # a module's own copy of a component -> the deployed one
        self.sets: dict[str, ReplicaSet] = {}
        self.queues: dict[tuple[str, str], BatchQueue] = {}  # (component uid, method) -> queue
        liveness = config.liveness
        checks = HealthChecks(liveness.health_check_period_s, liveness.health_check_timeout_s, liveness.health_check_failures)
        self.supervisor = Supervisor(
            backend, self._replica_up, self._replica_down, drain_timeout_s=liveness.drain_timeout_s, health=checks
        )
        self.autoscaler = Autoscaler(config, policy, self.supervisor, self.sets, self.one_more, clock=clock)
        self.prefetcher = Prefetcher(find_routes(pipeline.graph) if config.slo.prefetch else [], self._submit_prefetch)
        self.calls: CallService | None = None  # takes the calls workers' components make to the components they hold
        self._handles: Handles | None = None

    # -- lifecycle --------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the queues, start every replica, then the autoscaler (when on); raises the first replica's start error."""
        self._handles = await self._start_handles()
        for name, component in self.components.items():
            self._build_queues(name, component)
        names = [name for name in self.components for _ in range(self.config.components[name].replicas)]
        placed = [(self.config.components[name].resource, self.config.components[name].units) for name in names]
        resources = self.supervisor.backend.place(placed, self.config.plan is not None)
        await self.supervisor.start([self._spec(name, pinned) for name, pinned in zip(names, resources, strict=True)])
        if self.config.autoscaling.autoscale:
            self.autoscaler.start()

    def _build_queues(self, name: str, component: Component) -> None:
        settings = self.config.components[name]
        replica_set = self.sets[name] = ReplicaSet(name, self.config.limits.max_inflight_batches, self.supervisor.mark_stuck,
                                                   abandoned_grace_s=self.config.liveness.abandoned_grace_s,
                                                   surge=self.supervisor.surge)
        uid = component._patchkit_spec.uid
        for method, made in make_methods(type(component)).items():
            self.queues[uid, method] = BatchQueue(
                replica_set,
                method,
                batch_size=settings.batch_sizes[method],
                batch_wait_s=self.config.limits.batch_wait_ms / 1000,
                max_retries=self.config.liveness.max_retries if made.retries is None else made.retries,
                timeout_s=made.timeout_s or self.config.liveness.call_timeout_s,
                concurrency=_concurrency(made.max_concurrency, settings.batch_sizes[method]),
                clock=self.clock,
            )

    def _spec(self, name: str, resources: ReplicaResources) -> ReplicaSpec:
        """A replica of component `name` pinned to `resources`: on the plan's resource type, reaching the
        deployed components it holds through the front-end where its backend needs that."""
        settings, component = self.config.components[name], self.components[name]
        device = settings.resource if self.config.plan is not None else None
        held = self._handles if self._handles is not None and constructor_components(component) else None
        return ReplicaSpec(name, component, resources, device, settings.units, held)

    def one_more(self, name: str) -> ReplicaSpec:
        """A replica to add to component `name`, placed beside its running ones; called by the autoscaler."""
        settings = self.config.components[name]
        running = self.supervisor.replicas()
        resources = self.supervisor.backend.place_one(settings.resource, settings.units, self.config.plan is not None, running)
        return self._spec(name, resources)

    async def _start_handles(self) -> Handles | None:
        """Where workers whose components hold components of this pipeline (a Grader given the `llm`) send
        those calls: a CallService started here, whose calls queue like the pipeline's own. Only for a
        backend whose workers call back (local worker processes): a Ray actor, and the inprocess backend's
        replicas (the user's own objects, on this loop), run the components they hold in place."""
        if not self.supervisor.backend.calls_held_through_frontend or not any(
            constructor_components(c) for c in self.components.values()
        ):
            return None
        self.calls = CallService(self._call_held, self.config.secret)
        address = await self.calls.start()
        return Handles(address, frozenset(self.names), self.config.liveness.request_timeout_s)

    async def stop_scaling(self) -> None:
        """Called first when the front-end closes: no replica is added, retired or prefetched for from now on."""
        await self.autoscaler.close()
        self.prefetcher.close()

    async def close(self) -> None:
        """Stop every replica, then the service of held components' calls; called once requests have drained."""
        await self.supervisor.close()
        if self.calls is not None:
            await self.calls.close()

    def _replica_up(self, replica: Replica) -> None:
        self.sets[replica.component].add(replica)

    def _replica_down(self, replica: Replica, reason: str) -> None:
        self.sets[replica.component].remove(replica)

    # -- calls --------------------------------------------------------------------------------------------------
    def deployed(self, component: Component) -> Component:
        """The deployed component a call of `component` goes to: itself, or the one a helper's module held
        where this process's import of that module made another object (`Pipeline.component_aliases`)."""
        return self.aliases.get(component._patchkit_spec.uid, component)

    def submit(
        self, queue: BatchQueue, component: Component, envelope: CallEnvelope, slack: float | None = None
    ) -> PendingCall:
        """Queue a call of `component` on `queue` (one of `queues`, its method's), routed by the component's
        `prefix_key`."""
        prefix = _prefix_key(component, queue.method, envelope.args, envelope.kwargs)
        return queue.submit(envelope, slack=slack, prefix=prefix)

    async def _call_held(self, uid: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
        """A worker's component called a component it holds: queue it as a pipeline call of that component."""
        name, queue = self.names.get(uid), self.queues.get((uid, method))
        if name is None or queue is None:
            return (False, Failure.verdict(PatchkitError(f"no queue serves {name or uid}.{method}")))
        return await self.submit(queue, self.components[name], CallEnvelope(args, kwargs)).future

    def _submit_prefetch(self, uid: str, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        return self.queues[uid, PREFETCH_METHOD].submit(CallEnvelope(args, {})).future


def _prefix_key(component: Component, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The component's `prefix_key` for a call; None, logged, when the component's own code raises."""
    try:
        return component.prefix_key(method, args, kwargs)
    except Exception:
        logger.exception("%r.prefix_key raised; the call is routed to the least-loaded replica", component)
        return None


def _concurrency(max_concurrency: int | None, batch_size: int) -> int | None:
    """Calls in flight per replica of a `max_concurrency` method: its configured batch size, up to that
    bound, so a plan (or deploy(batch_size=...)) that chose c calls at once runs c; None: batched here."""
    return None if max_concurrency is None else min(max_concurrency, batch_size)
