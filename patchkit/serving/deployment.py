"""A deployment's serving parts, wired from its config and plan: replica sets, queues, supervisor, autoscaler.

Shared by every pipeline the front-end (frontend.py) serves, and by every version of each: one
`ReplicaSet` per component, one `BatchQueue` per (component, method) with the batch size the config
(or its plan) gives it, the `Supervisor` that starts the replicas the backend places, the
`Autoscaler` and the `Prefetcher`; which deployed component serves each component a pipeline calls is
served.py's (`ServedComponents`, which a Deployment is). Nothing here derives a digest.

`add` starts a version's new components, all or none, each with the options of the component it is a new
version of (`replaced`); `add_apart` starts the first pipelines' components each on its own, failing (`fail`)
those that cannot start while the others serve; `adopt` then serves the version's calls with them, and `release`
stops those no version in use calls (or, when what follows `add` fails, those `add` started).
The request runner submits each component call here (`submit`), as do the workers whose components
call the components they hold (`CallService`) and the prefetcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from patchkit.capture.holders import constructor_components
from patchkit.config import ComponentConfig, DeploymentConfig
from patchkit.core import Component, make_methods
from patchkit.errors import PatchkitError
from patchkit.orchestrator.backend import Backend, Replica, ReplicaSpec
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.execute import Failure, Outcome
from patchkit.orchestrator.handles import CallService, Handles
from patchkit.orchestrator.resources import ReplicaResources
from patchkit.orchestrator.supervisor import HealthChecks, Supervisor
from patchkit.program.identity import stamped_digest
from patchkit.scheduler.online.slo import SloPolicy
from patchkit.serving.prefetch import PREFETCH_METHOD, Prefetcher, PrefetchRoute, find_routes
from patchkit.serving.queues import BatchQueue, PendingCall
from patchkit.serving.replicas import ReplicaSet
from patchkit.serving.scaling import Autoscaler
from patchkit.serving.served import ServedComponents, pipeline_uids

if TYPE_CHECKING:
    from patchkit.program.pipeline import Pipeline  # the top layer: a type only

__all__ = ["Deployment"]

T = TypeVar("T")

logger = logging.getLogger(__name__)


class Deployment(ServedComponents):
    """The replicas and queues of every component the front-end's pipelines call, on the backend the config chose.

    Lives on the front-end's event loop. `policy` is the request runners' SLO policy, which the
    autoscaler reads (are requests at risk?). `config.components` holds the sizes of every deployed
    component, those `add` deployed later included.
    """

    def __init__(
        self, config: DeploymentConfig, backend: Backend, policy: SloPolicy, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.config = config
        self.clock = clock
        super().__init__()
        self.starting: set[str] = set()  # components `add` is starting: they serve nothing yet
        self.sets: dict[str, ReplicaSet] = {}
        self.retiring: set[str] = set()  # components `release` is stopping: no version calls them any more
        self.queues: dict[tuple[str, str], BatchQueue] = {}  # (component uid, method) -> queue
        liveness = config.liveness
        checks = HealthChecks(liveness.health_check_period_s, liveness.health_check_timeout_s, liveness.health_check_failures)
        self.supervisor = Supervisor(
            backend, self._replica_up, self._replica_down, drain_timeout_s=liveness.drain_timeout_s, health=checks,
            on_failed=self._component_failed,
        )
        self.autoscaler = Autoscaler(config, policy, self.supervisor, self.sets, self.one_more, clock=clock)
        self.prefetcher = Prefetcher([], self._submit_prefetch)
        self.calls: CallService | None = None  # takes the calls workers' components make to the components they hold
        self._calls_address = ""

    # -- lifecycle --------------------------------------------------------------------------------------------
    async def add(self, components: Mapping[str, Component], replaced: Mapping[str, str] | None = None,
                  rollable: Mapping[str, str] | None = None) -> dict[str, str]:
        """Deploy `components` (by the names `new_components` gave); `adopt` then serves a version's calls with them.

        Each gets its `config.components` sizes; one without, a new version of a deployed component (`replaced`:
        new name -> that one's), gets that one's sizes and per-component options (`DeploymentConfig.carry`), any
        other one replica with its methods' default batch sizes. Then its queues, then its replicas, all started
        before any serves a call; then the autoscaler, the first time when the config's `autoscale` is on. Raises
        the first replica's start error (or the cancellation of the update), with every replica of `components`
        stopped and nothing else changed.

        `rollable`: of `replaced`, those whose old component the update retires. Where the backend has no room
        for every replica of `components` beside those running (`Backend.room`), these start none: they are
        returned (new name -> old), "starting" until a `RollingUpdate` has started their first replica in place
        of an old one's."""
        names = list(components)
        self._prepare(components, replaced or {})
        rolls = self._rolls(names, rollable or {})
        await self._starting(names, self._start([name for name in names if name not in rolls]))
        self.starting.update(rolls)
        self._scale(names)
        return rolls

    async def add_apart(self, components: Mapping[str, Component]) -> dict[str, Exception]:
        """Deploy the first pipelines' `components` (as `add`), each on its own: one that cannot start is failed
        (`fail`) while the others serve; returns each failed one's start error, by name. Called by the front-end's
        `start`. Raises what fails them all (their placement, the service of held components' calls) or the
        start's cancellation, with every replica of `components` stopped and nothing else changed."""
        names = list(components)
        self._prepare(components, {})
        errors = await self._starting(names, self._start_apart(names))
        for name, error in errors.items():
            self.fail(name, f"{name} is failed: it could not start: {type(error).__name__}: {error}",
                      f"it could not start ({type(error).__name__})")
        self._scale(names)
        return errors

    def _prepare(self, components: Mapping[str, Component], replaced: Mapping[str, str]) -> None:
        """Give each of `components` its sizes (see `add`), then register it and build its queues."""
        for name, component in components.items():
            old = replaced.get(name)
            if old is not None and name not in self.config.components:
                self.config.carry(old, name, self._sizes(component, old))
            self.config.components.setdefault(name, self._sizes(component, None))
            self._register(name, component)

    async def _starting(self, names: list[str], start: Coroutine[Any, Any, T]) -> T:
        """Run `start`, components `names` "starting" meanwhile; on its error or cancellation, every replica of
        `names` is stopped and they are forgotten."""
        self.starting.update(names)
        started = asyncio.ensure_future(start)
        try:
            return await asyncio.shield(started)
        except BaseException:  # a start error, or the update cancelled: its starts end (a worker may be spawning)
            with contextlib.suppress(BaseException):
                await started
            await asyncio.gather(*self.supervisor.forget(names), return_exceptions=True)
            self._forget(names)
            raise
        finally:
            self.starting.difference_update(names)

    def _scale(self, names: list[str]) -> None:
        """The autoscaler watches components `names` too; it starts the first time, where the config's `autoscale` is on."""
        self.autoscaler.track(names)
        if self.config.autoscaling.autoscale and not self.autoscaler.running:
            self.autoscaler.start()

    async def _start(self, names: list[str]) -> None:
        await self.supervisor.start(await self._specs(names))

    async def _start_apart(self, names: list[str]) -> dict[str, Exception]:
        return await self.supervisor.start_apart(await self._specs(names))

    def _rolls(self, names: list[str], rollable: Mapping[str, str]) -> dict[str, str]:
        """Of `rollable`, those to replace a few replicas at a time: all, where the backend has no room for every
        replica of components `names` at once; else none."""
        if not rollable:
            return {}
        wanted = [self.one_more(name) for name in names for _ in range(self.config.components[name].replicas)]
        if self.supervisor.backend.room(wanted):
            return {}
        logger.warning("no room for a second copy of %s beside the running one: replacing their replicas a few at a "
                       "time (a rolling update)", ", ".join(rollable))
        return dict(rollable)

    def fail(self, name: str, why: str, kind: str) -> None:
        """Fail component `name`: nothing of it starts again until an update revives it (`revive`), and its calls are
        answered at once with ComponentFailed(`why`). `kind`: what the probes say of it, with no error text."""
        self.supervisor.mark_failed(name, why, kind)

    def failed_of(self, pipeline: Pipeline) -> dict[str, str]:
        """Of the components that serve `pipeline`'s calls, the failed ones, with why; empty while none is."""
        failed = self.supervisor.failed
        if not failed:
            return {}
        return {name: failed[name] for name in sorted(self.holds(pipeline)) if name in failed}

    def fail_waiting(self, name: str, error: PatchkitError) -> None:
        """Fail every call waiting in component `name`'s queues with `error`: it will serve none (an update that
        switched to it first was rolled back)."""
        replica_set = self.sets.get(name)
        for queue in [] if replica_set is None else replica_set.queues:
            queue.fail_waiting(error)

    def _sizes(self, component: Component, replaced: str | None) -> ComponentConfig:
        """A component's sizes where the config has none: those of component `replaced`, of which it is a new
        version (a method it adds at its default batch size), else one replica with its methods' defaults."""
        defaults = {method: component.batch_limit(method) for method in make_methods(type(component))}
        old = None if replaced is None else self.config.components.get(replaced)
        if old is None:
            return ComponentConfig(replicas=1, batch_sizes=defaults)
        return replace(old, batch_sizes={method: old.batch_sizes.get(method, size) for method, size in defaults.items()})

    def _register(self, name: str, component: Component) -> None:
        self.components[name] = component
        self.names[component._patchkit_spec.uid] = name
        self.fingerprints.setdefault(stamped_digest(component), name)
        self._build_queues(name, component)

    async def _specs(self, names: list[str]) -> list[ReplicaSpec]:
        """A spec per replica of components `names`, placed together by the backend."""
        if any(constructor_components(self.components[name]) for name in names):
            await self._start_calls()
        names = [name for name in names for _ in range(self.config.components[name].replicas)]
        placed = [(self.config.components[name].resource, self.config.components[name].units) for name in names]
        resources = self.supervisor.backend.place(placed, self.config.plan is not None)
        return [self._spec(name, pinned) for name, pinned in zip(names, resources, strict=True)]

    def adopt(self, pipelines: Iterable[Pipeline]) -> None:
        """Serve `pipelines`' components with the deployed ones (`add` started those that were missing): their own
        objects, those of a deployed one's fingerprint, and the copies their helpers' modules hold; and their
        prefetch routes, between deployed ones. All or nothing: raises PatchkitError, with nothing changed, for a
        component no deployed one serves."""
        aliases: dict[str, Component] = {}
        routes: list[PrefetchRoute] = []
        for pipeline in pipelines:
            for component in pipeline.components.values():
                served = self._serving(component)
                if served is None:
                    raise PatchkitError(f"no deployed component serves {component!r}: add() it first")
                if served._patchkit_spec.uid != component._patchkit_spec.uid:
                    aliases[component._patchkit_spec.uid] = served
            for uid, component in pipeline.component_aliases().items():
                aliases[uid] = aliases.get(component._patchkit_spec.uid, self.deployed(component))
            if self.config.slo.prefetch:
                routes.extend(find_routes(pipeline.graph))
        self.aliases.update(aliases)
        self.prefetcher.add_routes([self._deployed_route(route) for route in routes])

    def forget_pipeline(self, retired: Pipeline, live: Iterable[Pipeline]) -> None:
        """Drop the aliases and prefetch routes `adopt` made for `retired` (a version no longer served, its requests
        ended), those a version `live` still has kept; called by the front-end as the version retires."""
        live = list(live)
        if self.config.slo.prefetch:
            kept_routes = {self._deployed_route(route) for pipeline in live for route in find_routes(pipeline.graph)}
            routes = [self._deployed_route(route) for route in find_routes(retired.graph)]
            self.prefetcher.remove_routes([route for route in routes if route not in kept_routes])
        kept = set().union(*(pipeline_uids(pipeline) for pipeline in live))
        for uid in pipeline_uids(retired) - kept:
            self.aliases.pop(uid, None)

    def _deployed_route(self, route: PrefetchRoute) -> PrefetchRoute:
        source = self.aliases.get(route.source_uid)
        target = self.aliases.get(route.target_uid)
        return replace(route, source_uid=route.source_uid if source is None else source._patchkit_spec.uid,
                       target_uid=route.target_uid if target is None else target._patchkit_spec.uid)

    async def release(self, names: Iterable[str]) -> None:
        """Stop components `names`, which no pipeline in use calls any more: each replica retired (its batches in
        flight come back first); then their queues, sizes, aliases and prefetch routes are dropped."""
        names = [name for name in names if name in self.components]
        if not names:
            return
        self.autoscaler.forget(names)
        self.retiring.update(names)  # no longer a component that serves: /readyz and /healthz look past it from now on
        try:
            await asyncio.gather(*self.supervisor.forget(names), return_exceptions=True)
        finally:
            self._forget(names)

    def _forget(self, names: list[str]) -> None:
        """Drop everything of components `names` but their replicas (stopped, or never started)."""
        for name in names:
            component = self.components.pop(name)
            uid = component._patchkit_spec.uid
            self.names.pop(uid, None)
            self.fingerprints = {f: n for f, n in self.fingerprints.items() if n != name}
            self.aliases = {u: c for u, c in self.aliases.items() if c is not component}
            self.queues = {key: queue for key, queue in self.queues.items() if key[0] != uid}
            self.prefetcher.drop_routes(uid)
            self.sets.pop(name, None)
            self.retiring.discard(name)
            self.config.drop(name)

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
        deployed components it holds through the front-end where its backend needs that, its component
        told the batch sizes (calls at once) its queues send it."""
        settings, component = self.config.components[name], self.components[name]
        device = settings.resource if self.config.plan is not None else None
        held = self._held_handles() if constructor_components(component) else None
        made = make_methods(type(component))
        sizes = {method: _concurrency(made[method].max_concurrency, size) or size
                 for method, size in settings.batch_sizes.items() if method in made}
        return ReplicaSpec(name, component, resources, device, settings.units, held, sizes)

    def one_more(self, name: str) -> ReplicaSpec:
        """A replica to add to component `name`, placed beside its running ones; called by the autoscaler."""
        settings = self.config.components[name]
        running = self.supervisor.replicas()
        return self._spec(name, self.supervisor.backend.place_one(settings.resource, settings.units,
                                                                  self.config.plan is not None, running))

    async def _start_calls(self) -> None:
        """Start, on first need, where workers whose components hold deployed components (a Grader given the
        `llm`) send those calls: a CallService whose calls queue like the pipelines' own. Only for a backend
        whose workers call back (local worker processes): a Ray actor, and the inprocess backend's replicas
        (the user's own objects, on this loop), run the components they hold in place."""
        if self.supervisor.backend.calls_held_through_frontend and self.calls is None:
            self.calls = CallService(self._call_held, self.config.secret)
            self._calls_address = await self.calls.start()

    def _held_handles(self) -> Handles | None:
        """What a holder's replica reaches the deployed components through: None until the CallService is up
        (and on a backend that needs none); every uid the deployment serves, those of aliases included."""
        if self.calls is None:
            return None
        uids = frozenset([*self.names, *self.aliases])
        return Handles(self._calls_address, uids, self.config.liveness.request_timeout_s)

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
        if replica.component in self.sets:
            self.sets[replica.component].remove(replica)

    def _component_failed(self, name: str, why: str) -> None:
        if name in self.sets:
            self.sets[name].fail(why)

    async def revive(self, pipelines: Iterable[Pipeline]) -> None:
        """Start again the replicas of the failed components (see `Supervisor`) that `pipelines` call: an update
        gives them another try. Their calls queue again at once. One that cannot start is failed again, with its
        start error, and the update goes on: called by the front-end once an update's pipelines are adopted."""
        held = set().union(*(self.holds(pipeline) for pipeline in pipelines))
        names = self.supervisor.revive([name for name in self.supervisor.failed if name in held])
        if not names:
            return
        logger.warning("starting the failed components %s again, as the deployment is updated", ", ".join(names))
        for name in names:
            self.sets[name].revive()
        try:
            await self.supervisor.start(await self._specs(names))
        except Exception as exc:
            for name in names:
                why = f"{name} is failed: started again by an update, it could not start: {type(exc).__name__}: {exc}"
                logger.error("%s", why)
                self.fail(name, why, f"started again by an update, it could not start ({type(exc).__name__})")

    # -- calls --------------------------------------------------------------------------------------------------
    def submit(
        self, queue: BatchQueue, component: Component, envelope: CallEnvelope, slack: float | None = None, priority: int = 0
    ) -> PendingCall:
        """Queue a call of `component` on `queue` (one of `queues`, its method's), routed by the component's
        `prefix_key`, ahead of calls of a lower `priority` (its pipeline's)."""
        prefix = _prefix_key(component, queue.method, envelope.args, envelope.kwargs)
        return queue.submit(envelope, slack=slack, prefix=prefix, priority=priority)

    async def _call_held(self, uid: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
        """A worker's component called a component it holds: queue it as a pipeline call of that component."""
        uid = self.aliases[uid]._patchkit_spec.uid if uid in self.aliases else uid
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
