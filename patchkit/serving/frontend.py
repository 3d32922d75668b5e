"""The front-end: one deployment serving one or several captured pipelines, each by name, on one event loop.

Made of three parts, each in its own module: the `Deployment` (deployment.py: replica sets, queues,
supervisor, autoscaler, shared by every pipeline), a `RequestRunner` per version of each pipeline
(runner.py: admission, the pipeline's code per request, its calls) and the `StatsCollector` (stats.py:
counters and the views of them). Built and driven by the front-end process (`patchkit.server`), which
hands it the backend the orchestrator built (`patchkit.config.backends.make_backend`).

`update` changes the pipelines while they serve: the components a new version adds are started (and
their `setup()` done) before any request reaches them, then the version takes every request that comes
after; a request runs wholly on the version it started with, and the components no version in use
calls any more are stopped once the requests on the old version have ended. An update that fails at
any step before its switch stops what it started; a retired version leaves the front-end's memory and
its request counts join its pipeline's "retired" ones. Whoever shows the list of pipelines (the MCP tools)
hears of each change that update makes through `on_change`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from patchkit.config import DeploymentConfig
from patchkit.config.deployment import check_pipeline_name
from patchkit.errors import ConfigError, InputError, PatchkitError, PipelineNotFound
from patchkit.orchestrator.backend import Backend
from patchkit.scheduler.online.slo import SloPolicy, make_estimator
from patchkit.serving.deployment import Deployment
from patchkit.serving.readiness import DRAINING, STARTING, Readiness, of_pipeline, of_pipelines, report_start
from patchkit.serving.rolling import RollingUpdate
from patchkit.serving.runner import RequestResult, RequestRunner
from patchkit.serving.stats import StatsCollector

if TYPE_CHECKING:
    from patchkit.core import Component
    from patchkit.program.pipeline import Pipeline  # the top layer: a type only

__all__ = ["Frontend", "Readiness", "RequestResult", "Version"]

logger = logging.getLogger(__name__)

@dataclass(eq=False)
class Version:
    """One version of a served pipeline: its name, its number (1, 2, ... per name), its content hash
    (`Pipeline.stamped`, computed where the user's code is) and the runner its requests run on."""

    name: str
    number: int
    digest: str
    pipeline: Pipeline
    runner: RequestRunner

    @property
    def tag(self) -> str:
        """`<number>-<digest>`: what each reply's `X-Pipeline-Version` header says."""
        return f"{self.number}-{self.digest}"

    def describe(self) -> dict[str, Any]:
        """As `GET /v1/pipelines` lists it."""
        return {"name": self.name, "version": self.number, "digest": self.digest, "inputs": list(self.pipeline.inputs),
                "output": self.pipeline.output, "inflight": self.runner.inflight}


class Frontend:
    """Pipelines deployed on `backend`, by name: `start`, then `query` as requests come, `update` and `remove`
    while they serve, then `drain` and `close`; `stats`, `snapshot`, `healthy` and `replica_stats` are the
    `StatsCollector`'s, `readiness` says whether it takes requests now (`/readyz`).

    `pipelines`: by name; one Pipeline alone is served under the config's chat model name. `clock`: what
    deadlines, queue waits and the SLO policies read; tests inject their own."""

    def __init__(
        self,
        pipelines: Mapping[str, Pipeline] | Pipeline,
        config: DeploymentConfig,
        backend: Backend,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.policy = SloPolicy(
            make_estimator(config.slo.estimator),
            prioritize=config.slo.prioritize,
            pause_admission=config.slo.pause_admission,
            admission_limit=config.slo.admission_queue_limit,
            clock=clock,
        )
        self.deployment = Deployment(config, backend, self.policy, clock=clock)
        self.collector = StatsCollector(self.deployment, self.policy, lambda: self.inflight)
        self.versions: dict[str, Version] = {}  # by pipeline name: the version new requests run on
        self._retiring: set[Version] = set()  # replaced or removed, until their requests have ended
        self._initial = dict(pipelines) if isinstance(pipelines, Mapping) else {config.chat.name: pipelines}
        self._first_names = tuple(self._initial)  # what the probes name while `start` runs
        self._updating = asyncio.Lock()
        self._releases: set[asyncio.Task[None]] = set()
        self._listeners: list[Callable[[], object]] = []  # `on_change`'s
        # What the server calls, each answered by the part it belongs to.
        self.healthy = self.collector.healthy
        self.snapshot = self.collector.snapshot
        self.stats = self.collector.stats
        self.replica_stats = self.collector.replica_stats
        self.started = False  # every replica `start` started is up
        self.closing = False
        self._draining: asyncio.Future[None] | None = None

    # -- serving ------------------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Start every pipeline's components, each on its own (`Deployment.add_apart`).

        A pipeline that calls a component that cannot start is failed, with its reason (one WARNING line each,
        naming the pipeline, the component and why), while the others serve: its requests are answered at once
        with ComponentFailed (503), its readiness is "failed". Raises the first failed component's start error,
        with nothing left running, where no pipeline can serve, or where any is failed and the config's
        `fail_fast` is set."""
        initial, self._initial = self._initial, {}  # the versions serving hold their pipelines: no copy kept here
        try:
            errors = await self._deploy(initial, ())
            failed = {name: self.deployment.failed_of(v.pipeline) for name, v in self.versions.items()}
            report_start(failed, errors, fail_fast=self.config.liveness.fail_fast)
        except BaseException:
            await self.deployment.close()
            raise
        self.started = True

    def route(self, name: str | None = None) -> Version:
        """The version that serves new requests of pipeline `name`; None: the only pipeline. Raises
        PipelineNotFound for a name not served, and InputError for None where several are."""
        if name is None:
            if len(self.versions) == 1:
                return next(iter(self.versions.values()))
            raise InputError(f"this endpoint serves several pipelines ({', '.join(self.versions)}): name one, as "
                             "POST /v1/pipelines/{name}/query or endpoint[name]")
        version = self.versions.get(name)
        if version is None:
            raise PipelineNotFound(name, list(self.versions))
        return version

    @property
    def pipeline(self) -> Pipeline:
        """The only pipeline served (see `route`)."""
        return self.route().pipeline

    async def query(
        self,
        inputs: dict[str, Any],
        slo_ms: float | None = None,
        *,
        pipeline: str | None = None,
        request_id: str | None = None,
        on_delta: Callable[[str], object] | None = None,
    ) -> RequestResult:
        """Run pipeline `pipeline` (None: the only one) on `inputs`, on its version as of now (`RequestRunner.query`)."""
        return await self.route(pipeline).runner.query(inputs, slo_ms, request_id=request_id, on_delta=on_delta)

    def describe(self, extra: Callable[[Version], dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Each pipeline served (`GET /v1/pipelines`), with its `state`: "ready" when each component it calls has
        a replica serving, "failed" (with its `reason`, error text included) when one of them is failed, else
        "unready", or "draining" once the endpoint stops; then each older version still ending its requests
        ("retiring"). `extra`: more fields of each version's row (the server's own)."""
        rows = []
        for version in self._live():
            held = sorted(self.deployment.holds(version.pipeline))
            failed = self.deployment.failed_of(version.pipeline)
            if version in self._retiring:
                state = "retiring"
            elif self.closing or not self.started:
                state = "draining" if self.closing else "starting"
            elif failed:
                state = "failed"
            else:
                serving = all(any(r.alive for r in self.deployment.sets[name].replicas) for name in held)
                state = "ready" if serving else "unready"
            row = {**version.describe(), "state": state, "components": held, **(extra(version) if extra else {})}
            if state == "failed":
                row["reason"] = "; ".join(failed.values())
            rows.append(row)
        return rows

    def describe_made(self, made: Mapping[str, Version],
                      extra: Callable[[Version], dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
        """The rows of `describe` of the versions an update made (`update`'s result), by pipeline name; what
        `Endpoint.update()` and the reloader are told."""
        return {row["name"]: row for row in self.describe(extra) if made.get(row["name"]) is not None
                and row["version"] == made[row["name"]].number}

    @property
    def inflight(self) -> int:
        """Requests in flight, on every version."""
        return sum(v.runner.inflight for v in self._live())

    def _live(self) -> list[Version]:
        return [*self.versions.values(), *self._retiring]

    # -- updates ------------------------------------------------------------------------------------------------
    def on_change(self, listener: Callable[[], object]) -> Callable[[], None]:
        """Call `listener()` on this loop once per update that changes what new requests run on (a new version, a
        pipeline added or removed, a failed update switching back), after its switch; one that raises is logged.
        Returns a function that stops the calls (the MCP server's, when it stops)."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _changed(self) -> None:
        for listener in list(self._listeners):
            try:
                listener()
            except Exception:
                logger.exception("a listener to the pipelines' changes failed")

    async def update(self, pipelines: Mapping[str, Pipeline], remove: Iterable[str] = ()) -> dict[str, Version]:
        """Serve `pipelines` (by name: a new version of one served, or one more), and stop serving `remove`.

        Their components that no deployed one serves (by object, or by version: everything its behaviour depends
        on, `patchkit.program.identity`, as the pipeline's caller stamped it) are started, `setup()` done, before
        any request reaches them; then each new version takes
        every request that comes after this returns, while the requests in flight end on the version they
        started on. Components no version in use calls any more are stopped once those requests have ended.
        A new version of a component gets the options the one it replaces was deployed with. Where the backend
        has no room for a second copy of a changed component, its replicas are swapped a few at a time
        (serving/rolling.py). One update at a time. Raises, with nothing changed that serves, for a pipeline or
        name that cannot be served, a component that cannot start (its error), or any step before the switch
        that fails. Cancelled (a withdrawn update), it is applied whole or not at all: nothing is awaited
        after the switch but a rolling update's swap, whose failure or cancellation switches back."""
        remove = list(remove)
        async with self._updating:
            self._check_update(pipelines, remove)
            numbers = {name: self.versions[name].number + 1 if name in self.versions else 1 for name in pipelines}
            await self._deploy(pipelines, remove, numbers)
            return {name: self.versions[name] for name in pipelines}

    async def remove(self, name: str) -> None:
        """Stop serving pipeline `name` (see `update`): its requests in flight end, then its components, where no
        other pipeline calls them, are stopped."""
        await self.update({}, [name])

    def _check_update(self, pipelines: Mapping[str, Pipeline], remove: list[str]) -> None:
        if self.closing:
            raise PatchkitError("the endpoint is shutting down: it takes no update")
        if not self.started:
            raise PatchkitError("the endpoint is starting: update it once its workers are up")
        for name in remove:
            self.route(name)
        if not set(self.versions).union(pipelines) - set(remove).difference(pipelines):
            raise ConfigError("an endpoint serves at least one pipeline: update it with another before removing the last")

    async def _deploy(self, pipelines: Mapping[str, Pipeline], remove: Iterable[str],
                      numbers: Mapping[str, int] | None = None) -> dict[str, Exception]:
        """Start what `pipelines` need, build their versions, then switch to them with no await in between: an
        update is applied whole or not at all. A failure (or the update's cancellation) at any step before the
        switch stops the components started for it, and the versions serving keep serving, unchanged.

        The first deployment (no `numbers`) starts each component on its own instead (`Deployment.add_apart`):
        returned, the start error of each that could not start, by name (failed, the others serve)."""
        first = numbers is None
        numbers = numbers or dict.fromkeys(pipelines, 1)
        for name, pipeline in pipelines.items():
            _check_pipeline(name, pipeline)
        await _stamped(pipelines.values())
        added = self.deployment.new_components(pipelines, numbers)
        served = {name: version.pipeline for name, version in self.versions.items()}
        replaced = self.deployment.replaced(pipelines, added, served)
        errors: dict[str, Exception] = {}
        if first:
            errors, rolls = await self.deployment.add_apart(added), {}
        else:
            rolls = await self.deployment.add(added, replaced, self._rollable(replaced, pipelines, remove))
        rolling = RollingUpdate(self.deployment, rolls)
        try:
            versions = [self._version(name, pipeline, numbers[name]) for name, pipeline in pipelines.items()]
            self.deployment.adopt(pipelines.values())
            if not first:  # a component the first deployment could not start is failed, not started again at once
                await self.deployment.revive(pipelines.values())
            await rolling.before_switch()
        except BaseException:
            await asyncio.shield(self._roll_back(added, rolling))  # a withdrawn update's cancellation ends no rollback
            raise
        previous = {name: self.versions.get(name) for name in [*pipelines, *remove]}
        held = versions if rolling.gap() else []  # no replica serves a component they call until the swap
        for version in held:
            version.runner.hold()
        for version in versions:
            self._switch(version.name, version)
        for name in remove:
            self._switch(name, None)
        if not first:
            self._changed()
        if held:
            await self._swap_after_switch(rolling, added, previous, held)
        if rolling.rolls:
            self._track(rolling.finish())
        if self.versions and not first:
            logger.info("serving %s", ", ".join(f"{v.name} version {v.tag}" for v in self.versions.values()))
        return errors

    def _rollable(self, replaced: Mapping[str, str], pipelines: Mapping[str, Pipeline],
                  remove: Iterable[str]) -> dict[str, str]:
        """Of `replaced` (new component -> the one it is a new version of), those whose old component no version
        that keeps serving after this update calls: a rolling update may swap its replicas for the new one's."""
        staying = [v.pipeline for name, v in self.versions.items() if name not in pipelines and name not in remove]
        held = set().union(*(self.deployment.holds(pipeline) for pipeline in staying))
        return {new: old for new, old in replaced.items() if old not in held}

    async def _roll_back(self, added: Mapping[str, Component], rolling: RollingUpdate) -> None:
        logger.warning("the update failed after its components started: stopping %s", ", ".join(added) or "none")
        await self.deployment.release(added)
        await rolling.undo()

    async def _swap_after_switch(self, rolling: RollingUpdate, added: Mapping[str, Component],
                                 previous: Mapping[str, Version | None], held: list[Version]) -> None:
        """The rolling update of old components with one replica: once the requests on the versions replaced have
        ended (within the drain timeout), their replica is swapped for the new one's, the new versions' requests
        held meanwhile (`RequestRunner.hold`), and then run on them. On failure, switch back: the requests held
        run on the versions that serve again, and nothing is lost."""
        try:
            waits = [old.runner.drained(self.config.liveness.drain_timeout_s) for old in previous.values() if old]
            await asyncio.gather(*waits)
            await rolling.after_switch()
        except BaseException as exc:
            error = exc if isinstance(exc, PatchkitError) else PatchkitError(f"the update was rolled back: {exc!r}")
            await asyncio.shield(self._switch_back(rolling, added, previous, error))
            for version in held:
                old = previous.get(version.name)
                version.runner.release(old.runner if old is not None else None)
            raise
        for version in held:
            version.runner.release()

    async def _switch_back(self, rolling: RollingUpdate, added: Mapping[str, Component],
                           previous: Mapping[str, Version | None], error: PatchkitError) -> None:
        for name, old in previous.items():
            if old is not None:
                self._retiring.discard(old)
            self._switch(name, old)
        self._changed()
        for name in rolling.rolls:
            self.deployment.fail_waiting(name, error)
        await self._roll_back(added, rolling)

    def _track(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def _version(self, name: str, pipeline: Pipeline, number: int) -> Version:
        assert pipeline.stamped is not None  # `_deploy` saw to it
        digest = pipeline.stamped.digest
        runner = RequestRunner(pipeline, self.config, self.deployment, self.policy, self.collector, name=name,
                               load=lambda: self.inflight, tag=f"{number}-{digest}", clock=self.clock)
        return Version(name, number, digest, pipeline, runner)

    def _switch(self, name: str, version: Version | None) -> None:
        """Send pipeline `name`'s new requests to `version` (None: none); the one it replaces retires."""
        old = self.versions.pop(name, None)
        if version is not None:
            self.versions[name] = version
        if old is not None:
            self._retiring.add(old)
            self._track(self._release_when_idle(old))

    async def _release_when_idle(self, old: Version) -> None:
        """Once `old`'s requests have ended: stop the components no version in use calls any more."""
        await old.runner.drained(None)
        async with self._updating:
            if old in self.versions.values():
                return  # an update that failed after its switch switched back to it
            self._retiring.discard(old)
            self.collector.retire(old.name, old.tag)  # its counts stay in the pipeline's, under no label of its own
            self.deployment.forget_pipeline(old.pipeline, [v.pipeline for v in self._live()])
            if self.closing:
                return
            held = set().union(*(self.deployment.holds(v.pipeline) for v in self._live()))
            unused = set(self.deployment.components) - held
            if unused:
                logger.info("stopping %s: no pipeline served calls it any more", ", ".join(sorted(unused)))
            await self.deployment.release(unused)

    # -- probes and shutdown ------------------------------------------------------------------------------------
    def readiness(self) -> Readiness:
        """Whether the front-end takes requests now, and if not why, with each pipeline's own and each component's
        not wholly ready (`patchkit.serving.readiness`); called by `/readyz`. "starting" until every replica `start`
        started is up, "draining" from `drain` on."""
        if not self.started or self.closing:
            own = DRAINING if self.closing else STARTING
            return Readiness(own.status, own.reasons, dict.fromkeys(self._names(), own))
        states = self.collector.not_ready()
        pipelines = {name: of_pipeline(self.deployment.holds(v.pipeline), states) for name, v in self.versions.items()}
        held = set().union(*(self.deployment.holds(version.pipeline) for version in self.versions.values()))
        return of_pipelines(pipelines, held, states)

    def pipeline_readiness(self, name: str) -> Readiness:
        """Pipeline `name`'s own readiness (`patchkit.serving.readiness.of_pipeline`), "starting" and "draining" as
        the front-end's; called by `/v1/pipelines/{name}/readyz`. Raises PipelineNotFound for a name not served."""
        if name not in self._names():
            raise PipelineNotFound(name, list(self._names()))
        if not self.started or self.closing:
            return DRAINING if self.closing else STARTING
        return of_pipeline(self.deployment.holds(self.versions[name].pipeline), self.collector.not_ready())

    def _names(self) -> tuple[str, ...]:
        return tuple(self.versions) if self.started else self._first_names

    async def drain(self) -> None:
        """Refuse new requests and updates, stop the autoscaler, then wait for in-flight requests (up to the
        drain timeout); called first when the server stops, while it still answers (`/readyz`: "draining").
        A second call waits for the first one's drain."""
        if self._draining is None:
            self.closing = True  # from now on: no request is admitted while the task below starts
            for version in self._live():
                version.runner.closing = True
            self._draining = asyncio.ensure_future(self._drain())
        await asyncio.shield(self._draining)

    async def _drain(self) -> None:
        await self.deployment.stop_scaling()
        waits = [v.runner.drained(self.config.liveness.drain_timeout_s) for v in self._live()]
        if not all(await asyncio.gather(*waits)):
            logger.warning("closing with %d requests still in flight after %.0f s", self.inflight,
                           self.config.liveness.drain_timeout_s)

    async def close(self) -> None:
        """`drain` (if not done yet), then stop every replica."""
        await self.drain()
        for task in list(self._releases):
            task.cancel()
        await self.deployment.close()


def _check_pipeline(name: object, pipeline: object) -> None:
    """A name a URL path and a model id take as it is, and a captured pipeline that calls a component."""
    check_pipeline_name(name)
    if not hasattr(pipeline, "components") or not hasattr(pipeline, "stamp"):
        raise ConfigError(f"pipeline {name!r} must be a Pipeline, as `with patchkit.capture() as pipeline:` makes; "
                          f"got {pipeline!r:.100}")
    if not pipeline.components:
        raise InputError(f"pipeline {name!r} calls no component: there is nothing to deploy")


async def _stamped(pipelines: Iterable[Pipeline]) -> None:
    """See that every pipeline carries its version. Those deployed from another process arrive with it (their
    caller stamped them where their code is); one handed to the front-end in its own process unstamped (the
    inprocess backend's, a test's) is stamped on a thread: digests never run on the loop that answers."""
    missing = [pipeline for pipeline in pipelines if pipeline.stamped is None]
    if missing:
        await asyncio.to_thread(lambda: [pipeline.stamp() for pipeline in missing])
