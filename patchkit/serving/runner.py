"""The request runner: admits a request, runs the captured pipeline code for it, and routes its component calls.

Each request runs the user's own pipeline code in a greenlet (`bridge.py`) with a call hook that
submits each `@make` call to its (component, method) batching queue (deployment.py) and waits there,
so the user's control flow runs unchanged while many requests share batches (component-level
batching) and sit at different components at once (pipelining). With parallel calls the code is the
rewritten one (capture/parallel.py): at its deferred call sites the hook hands back a `Pending` at once,
kept in the request's `Window` (capture/pending.py), so a request's independent calls are in flight
together and the code waits where each result is first used. Every request ends under one outcome
name, `outcome_of`, which its counters, its metrics and its trace all read. On the front-end's loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from patchkit import telemetry
from patchkit.capture.pending import Window, run_in_window
from patchkit.config import DeploymentConfig
from patchkit.core import CallSite, Component, MakeMethod, call_hook, make_methods
from patchkit.core.options import Answer, CallOptions, CallReport, honoured_options
from patchkit.errors import ComponentFailed, DeadlineExceeded, Overloaded, WorkerDiedError
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.scheduler.online.slo import RequestState, SloPolicy
from patchkit.scheduler.online.traces import Visit
from patchkit.serving.bridge import await_, run_sync
from patchkit.serving.deployment import Deployment
from patchkit.serving.queues import BatchQueue, PendingCall
from patchkit.serving.stats import StatsCollector
from patchkit.serving.steps import CallStep, PreviewLimits, RequestSteps, StepEvent
from patchkit.serving.waves import Waves

if TYPE_CHECKING:
    from patchkit.program.pipeline import Pipeline  # the top layer: a type only

__all__ = ["FieldDelta", "RequestResult", "RequestRunner", "outcome_of"]


def outcome_of(error: BaseException | None) -> str:
    """How a request ended, by what it raised (None: it was answered): ok, timeout, overloaded,
    worker_died, cancelled or error. The one mapping counters, metrics and traces use."""
    if error is None:
        return "ok"
    if isinstance(error, asyncio.CancelledError):
        return "cancelled"
    if isinstance(error, DeadlineExceeded):
        return "timeout"
    if isinstance(error, Overloaded):
        return "overloaded"
    if isinstance(error, WorkerDiedError):
        return "worker_died"
    return "error"


@dataclass
class RequestResult:
    request_id: str
    output: Any
    latency_s: float
    version: str = ""  # the tag of the pipeline version that ran it (`Version.tag`)
    report: CallReport | None = None  # what the call that answered reported (its tokens, why it ended), if it did


class FieldDelta(NamedTuple):
    """A text chunk of field `field` of a dict output, as a stream of several fields' calls hands it on."""

    field: str
    text: str


@dataclass(frozen=True)
class _Request:
    """What a request's component calls need of it: its SLO state, when it times out (the event loop's
    time), its span, where the chunks of its output go when it streams, and its calls' steps."""

    state: RequestState
    expires: float
    span: telemetry.Span
    on_delta: Callable[[Any], object] | None
    steps: RequestSteps
    answering: frozenset[CallSite] = frozenset()  # the sites of the call that answers it (`RequestRunner.answering`)
    options: CallOptions | None = None  # for that call
    field: str | None = None  # the field of a dict output it asks for (None: the whole output)
    reports: list[CallReport] = dataclasses.field(default_factory=list)  # what that call reported, each time it ran


class RequestRunner:
    """Runs one pipeline version's requests against a started `Deployment`; `policy` admits them and watches
    their SLO. `name`: its pipeline's, which picks its `slo_ms` and `priority` from the config. `load`: the
    requests in flight the admission limit counts (every version's: the front-end's), else this runner's own.
    `tag`: the version's, set in each result."""

    def __init__(
        self,
        pipeline: Pipeline,
        config: DeploymentConfig,
        deployment: Deployment,
        policy: SloPolicy,
        stats: StatsCollector,
        *,
        name: str = "",
        load: Callable[[], int] | None = None,
        tag: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pipeline = pipeline
        self.name, self.tag = name, tag
        self.slo_ms = config.slo.slo_of(name)  # of its requests that bring none
        self.priority = config.slo.priority_of(name)
        self.config = config
        self.deployment = deployment
        self.policy = policy
        self.stats = stats
        self.clock = clock  # the SLO policy's and the queues' clock; tests inject their own
        self.waves = None if config.limits.pipelining else Waves()
        self.site_fields = pipeline.graph.site_fields()  # of a dict output, the field each of those makes
        self._answering: dict[str | None, frozenset[CallSite]] = {}
        self._honoured: dict[str | None, frozenset[str]] = {}
        self.parallel = config.limits.parallel_calls and pipeline.parallel  # calls to overlap, and overlapping on
        self.inflight = 0
        self.load: Callable[[], int] = load or (lambda: self.inflight)
        self.closing = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._held: asyncio.Future[RequestRunner] | None = None  # `hold`: where the requests held will run

    async def query(
        self,
        inputs: dict[str, Any],
        slo_ms: float | None = None,
        *,
        request_id: str | None = None,
        on_delta: Callable[[Any], object] | None = None,
        on_step: Callable[[StepEvent], object] | None = None,
        options: CallOptions | None = None,
        field: str | None = None,
    ) -> RequestResult:
        """Run the pipeline on inputs checked at the edge (`patchkit.server.inputs`); raises what the request should answer.

        `request_id`: the request's id (the client's X-Request-ID, checked at the edge), else a fresh
        one; it is in the result, the request's traces and spans. `on_delta`: called on this loop with
        each text chunk of the calls whose result is the pipeline's output, or an item of it
        (`stream=True` methods the captured graph connects to the output), as they are made: a str, or, where
        a dict output has several fields made so and no `field` is asked for, a `FieldDelta` naming its field.
        `field`: the field of a dict output the request is answered with (the chat API's `chat_output`):
        only its call streams. `options`: for the call that answers it (`answering`); the others keep
        their own settings. The result carries that call's `CallReport` where it made one.
        `on_step`: called on this loop with each step event of the request's component calls, as each
        starts and ends, in that order (`patchkit.serving.steps`).
        Cancelling the query (its client went away) withdraws its queued calls and stops its running
        ones where they can stop; it counts as `cancelled`. While a component that serves the pipeline's calls is
        failed (`Deployment.fail`), the query raises ComponentFailed at once, naming the pipeline and why.
        """
        if self._held is not None:  # a version switched to before its components serve (`hold`)
            serving = await asyncio.shield(self._held)
            if serving is not self:
                return await serving.query(inputs, slo_ms, request_id=request_id, on_delta=on_delta, on_step=on_step,
                                           options=options, field=field)
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        span = telemetry.start_request(request_id, self.name, self.tag)
        server = self.config.server
        steps = RequestSteps(request_id, self.name, self.tag, on_step, previews=server.steps == "previews",
                             limits=PreviewLimits(chars=server.step_preview_chars))
        error: BaseException | None = None
        try:
            return await self._query(inputs, slo_ms, request_id, span, on_delta, steps, options, field)
        except BaseException as exc:
            error = exc
            raise
        finally:
            outcome = outcome_of(error)
            if error is not None:
                self.stats.count(outcome, self.name, self.tag)
            telemetry.end_request(span, outcome)
            steps.finish(outcome, time.perf_counter() - steps.arrived)
            self.stats.recent.add(steps)

    def hold(self) -> None:
        """Hold the requests that arrive from now on, none of their code run, until `release`; called by the
        front-end for a version it switches to before a component it calls has a replica (a rolling update
        of a component with one): a request the update's failure would fail waits instead, then runs on the
        version that serves."""
        self._held = asyncio.get_running_loop().create_future()

    def release(self, serving: RequestRunner | None = None) -> None:
        """Run the requests `hold` held on `serving` (None: this runner), and those that come after them here."""
        held, self._held = self._held, None
        if held is not None and not held.done():
            held.set_result(serving or self)

    async def _query(
        self,
        inputs: dict[str, Any],
        slo_ms: float | None,
        request_id: str,
        span: telemetry.Span,
        on_delta: Callable[[Any], object] | None,
        steps: RequestSteps,
        options: CallOptions | None = None,
        field: str | None = None,
    ) -> RequestResult:
        if self.closing:
            raise Overloaded(self.load(), 0, "the endpoint is shutting down")
        if failed := self.deployment.failed_of(self.pipeline):  # answered now: it would fail where it reached one
            raise ComponentFailed(f"pipeline {self.name} cannot serve: {'; '.join(failed.values())}")
        if (load := self.load()) >= self.config.limits.max_inflight_requests:
            raise Overloaded(load, self.config.limits.max_inflight_requests)
        start = time.perf_counter()
        expires = asyncio.get_running_loop().time() + self.config.liveness.request_timeout_s
        variables = self.pipeline.variables(inputs)
        slo = slo_ms or self.slo_ms
        state = self.policy.start(request_id, inputs, slo, self.name)
        self.inflight += 1
        self._idle.clear()
        ok = False
        try:
            request = _Request(state, expires, span, on_delta, steps, self.answering(field), options, field)
            output = await self._admitted(variables, request)
            ok = True
        finally:
            self.policy.finish(state, ok=ok)
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()
        latency = time.perf_counter() - start
        self.stats.answered(latency, slo, self.name, self.tag)
        report = request.reports[-1] if request.reports else None
        return RequestResult(request_id, output, latency, self.tag, report)

    async def _admitted(self, variables: dict[str, Any], request: _Request) -> Any:
        """Wait for admission (and the request's wave), then run the pipeline's code; within the request's timeout.

        Its own deadline ends it with DeadlineExceeded; a TimeoutError the pipeline's code or a component
        raised is that code's error, raised as it is."""
        entered = False
        limit = self.config.liveness.request_timeout_s
        try:
            async with asyncio.timeout(limit) as deadline:
                await self.policy.admit(request.state)
                if self.waves is not None:
                    await self.waves.enter()
                    entered = True
                return await run_sync(self._run, variables, request)
        except TimeoutError:
            if not deadline.expired():
                raise
            raise DeadlineExceeded(f"request {request.state.id} ran past request_timeout_s={limit:g}") from None
        finally:
            if entered:
                assert self.waves is not None
                self.waves.leave()

    def answering(self, field: str | None = None) -> frozenset[CallSite]:
        """The call sites of the call that answers a request: whose result is the output, or field `field` of a
        dict output. A streaming request follows its chunks; the request's options reach it."""
        if field not in self._answering:
            self._answering[field] = self.pipeline.graph.field_sites(field)
        return self._answering[field]

    def honoured(self, field: str | None = None) -> frozenset[str]:
        """The call options every call that may answer a request (asking for `field`) honours: those of its
        components' `honoured_options` whose method takes `options`; none where no call answers."""
        if field not in self._honoured:
            graph, components = self.pipeline.graph, self.pipeline.graph.components()
            found: list[frozenset[str]] = []
            for site in self.answering(field):
                node = graph.node_at(site)
                component = components.get(node.component) if node is not None else None
                method = make_methods(type(component)).get(node.method) if node is not None else None
                takes = component is not None and method is not None and method.takes_options
                found.append(honoured_options(component) if takes else frozenset())
            self._honoured[field] = frozenset.intersection(*found) if found else frozenset()
        return self._honoured[field]

    def _sink(self, request: _Request, method: MakeMethod, site: CallSite | None) -> Callable[[str], object] | None:
        """Where an answering call's chunks go: the request's `on_delta` for a streaming method (None: nowhere);
        as `FieldDelta`s where the request asks for no field and the output has several streamed fields."""
        if not method.stream or request.on_delta is None:
            return None
        field = self.site_fields.get(site) if site is not None else None
        if request.field is not None or field is None or len(set(self.site_fields.values())) < 2:
            return request.on_delta
        return functools.partial(_named_delta, request.on_delta, field)

    async def drained(self, timeout_s: float | None) -> bool:
        """Wait up to `timeout_s` (None: as long as it takes) for the requests in flight (once `closing` refuses
        new ones, or no more are sent here); whether they all ended."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _run(self, variables: dict[str, Any], request: _Request) -> Any:
        """The request's greenlet: its pipeline code, with the call hook and, for parallel calls, its window."""
        if not self.parallel:
            with call_hook(functools.partial(self._call, request, None)):
                return self.pipeline.run(variables)
        window = Window()
        with call_hook(functools.partial(self._call, request, window)):
            return run_in_window(window, functools.partial(self.pipeline.run, variables, parallel=True))

    def _call(
        self, request: _Request, window: Window | None, component: Component, method: MakeMethod,
        args: tuple[Any, ...], kwargs: dict[str, Any], site: CallSite | None,
    ) -> Any:
        """The call hook, inside a request's greenlet: queue the call; wait for its outcome, or, at a call
        site the parallel program defers, hand back its `Pending` (waited for where its result is used). A
        call of a method not `read_only=True` is made only once every call the request made before it has
        ended, and is waited for in place, whatever its site.

        The request's calls are withdrawn when it ends (their futures are cancelled with it), and a
        worker does not run one past `request.expires`, the event loop's time when it times out."""
        if window is not None and not method.read_only:
            window.settle()  # it keeps plain Python's place: made once every call before it has ended, or not at all
        component = self.deployment.deployed(component)
        queue = self.deployment.queues.get((component._patchkit_spec.uid, method.name))
        if queue is None:
            # A component the pipeline creates as it runs has no workers: it runs here, off the loop.
            return await_(asyncio.to_thread(method.run_local, component, args, kwargs))
        submitted = self._submit(request, queue, component, method, args, kwargs, site)
        if window is not None and method.read_only and site is not None and site.deferred:
            return window.add(functools.partial(self._wait, submitted), submitted.call.future.cancel)
        return self._wait(submitted)

    def _submit(
        self, request: _Request, queue: BatchQueue, component: Component, method: MakeMethod, args: tuple[Any, ...],
        kwargs: dict[str, Any], site: CallSite | None,
    ) -> _Submitted:
        """Queue one call: its prefetch, span, slack and envelope; its span and visit end with its future."""
        deployment, uid = self.deployment, component._patchkit_spec.uid
        if (uid, method.name) in deployment.prefetcher.sources:
            deployment.prefetcher.on_call(component, method.name, site, args, kwargs)
        name, state = deployment.names[uid], request.state
        node = self.pipeline.graph.node_at(site) if site is not None else None
        step = request.steps.start(node.id if node is not None else None, name, method.name,
                                   sensitive=bool(getattr(component, "sensitive", False)))
        call_span, carrier = telemetry.start_call(request.span, name, method.name)
        slack = self.policy.check(state) if state.deadline is not None else None  # an SLO applies: the slack
        answers = site is not None and site in request.answering
        if answers and request.options is not None and method.takes_options:
            kwargs = {**kwargs, "options": request.options}
        envelope = CallEnvelope(args, kwargs, request.expires, self._sink(request, method, site) if answers else None,
                                trace=carrier)
        call = deployment.submit(queue, component, envelope, slack, self.priority)
        submitted = _Submitted(name, method.name, call, answers)
        submitted.call.future.add_done_callback(
            functools.partial(self._ended, submitted, request, step, call_span, time.time_ns(), self.clock(), _size(args))
        )
        return submitted

    def _ended(
        self, submitted: _Submitted, request: _Request, step: CallStep, span: telemetry.Span, submitted_ns: int,
        started: float, size: int, future: asyncio.Future[Any],
    ) -> None:
        """When a call's outcome is in (whether or not its request has looked yet): its step ends, its span ends
        and, under an SLO, its visit is recorded, so a request's trace sees its calls as they come back."""
        call, state = submitted.call, request.state
        wait = call.waited if call.dispatched is not None else None
        if future.cancelled() or future.exception() is not None:
            why = "the request ended" if future.cancelled() else str(future.exception())
            request.steps.end(step, batch=call.batch, replica=call.replica, wait_s=wait,
                              error=("Cancelled", why) if future.cancelled() else (type(future.exception()).__name__, why))
            telemetry.end_call(span, submitted_ns, None, "cancelled" if future.cancelled() else why)
            return
        ok, value = future.result()
        if ok and submitted.answers and isinstance(value, Answer):
            request.reports.append(value.report)
        request.steps.end(step, batch=call.batch, replica=call.replica, wait_s=wait,
                          result=value if ok else None, error=None if ok else (value.type_name, value.message))
        if span is not None:
            dispatched_ns = None if call.dispatched is None else time.time_ns() - int((self.clock() - call.dispatched) * 1e9)
            telemetry.end_call(span, submitted_ns, dispatched_ns, None if ok else value.message)
        if state.deadline is not None:
            stage = f"{submitted.component}.{submitted.method}"
            visit = Visit(stage, submitted.component, started, self.clock(), size, _size(value), call.waited)
            self.policy.record(state, visit)

    def _wait(self, submitted: _Submitted) -> Any:
        """Wait in the request's greenlet for a submitted call: its result, or its error raised."""
        ok, value = await_(submitted.call.future)
        if ok:
            return value
        value.raise_for(submitted.component, submitted.method)


class _Submitted(NamedTuple):
    """A call in its queue, as the request that made it knows it."""

    component: str  # its name in the deployment
    method: str
    call: PendingCall
    answers: bool = False  # it is the call that answers its request (`RequestRunner.answering`)


def _named_delta(on_delta: Callable[[Any], object], field: str, text: str) -> object:
    return on_delta(FieldDelta(field, text))


def _size(value: Any) -> int:
    """A cheap size of a call's input or output for the estimators: the length of a string or collection."""
    if isinstance(value, tuple) and len(value) == 1:
        value = value[0]
    return len(value) if isinstance(value, (str, list, tuple, dict)) else 1
