"""The front-end: runs the captured pipeline once per request, every component call a remote call.

Each request runs the user's own pipeline code in a greenlet (`bridge.py`) with a call hook that
sends each `@make` call to its (component, method) batching queue and waits there, so the user's
control flow runs unchanged while many requests share batches (component-level batching) and
sit at different components at once (pipelining). Lives on one event loop, driven by `http.py`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from patchkit import telemetry
from patchkit.capture.holders import constructor_components
from patchkit.capture.recorder import site_of
from patchkit.component import Component, MakeMethod, call_hook, make_methods
from patchkit.config import DeploymentConfig
from patchkit.errors import DeadlineExceeded, Overloaded, PatchkitError, WorkerDiedError
from patchkit.orchestrator.backend import Backend, Replica, ReplicaSpec
from patchkit.orchestrator.execute import Failure, Outcome
from patchkit.orchestrator.handles import CallService, Handles
from patchkit.orchestrator.inprocess import InProcessBackend
from patchkit.orchestrator.local import LocalBackend
from patchkit.orchestrator.resources import ReplicaResources, assign, cpu_threads, spread
from patchkit.orchestrator.supervisor import HealthChecks, Supervisor
from patchkit.scheduler.online.autoscale import Autoscaler
from patchkit.scheduler.online.bridge import await_, run_sync
from patchkit.scheduler.online.prefetch import PREFETCH_METHOD, Prefetcher, find_routes
from patchkit.scheduler.online.queues import BatchQueue, ReplicaSet
from patchkit.scheduler.online.request_ids import REQUEST_ID, new_request_id
from patchkit.scheduler.online.slo import RequestState, SloPolicy, make_estimator
from patchkit.scheduler.online.snapshot import LATENCY_BUCKETS_S, FrontendSnapshot, MethodSnapshot
from patchkit.scheduler.online.traces import Visit
from patchkit.scheduler.online.waves import Waves

if TYPE_CHECKING:
    from patchkit.client.pipeline import Pipeline  # the top layer: a type only

__all__ = ["Frontend", "RequestResult", "make_backend"]

logger = logging.getLogger(__name__)


@dataclass
class RequestResult:
    request_id: str
    output: Any
    latency_s: float


class Frontend:
    def __init__(
        self, pipeline: Pipeline, config: DeploymentConfig, backend: Backend, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.pipeline = pipeline
        self.config = config
        self.clock = clock  # deadlines, queue waits and the SLO policies read it; tests inject their own
        self.components: dict[str, Component] = pipeline.components
        self.sets: dict[str, ReplicaSet] = {}
        self.queues: dict[tuple[str, str], BatchQueue] = {}  # (component uid, method) -> queue
        self._names = {c._patchkit_spec.uid: name for name, c in self.components.items()}
        checks = HealthChecks(config.health_check_period_s, config.health_check_timeout_s, config.health_check_failures)
        self.supervisor = Supervisor(
            backend, self._replica_up, self._replica_down, drain_timeout_s=config.drain_timeout_s, health=checks
        )
        self.policy = SloPolicy(
            make_estimator(config.estimator),
            prioritize=config.prioritize,
            pause_admission=config.pause_admission,
            admission_limit=config.admission_queue_limit,
            clock=clock,
        )
        self.autoscaler = Autoscaler(self.config, self.policy, self.supervisor, self.components, self.sets, clock=clock)
        routes = find_routes(pipeline.graph) if config.prefetch else []
        self.prefetcher = Prefetcher(routes, self._submit_prefetch)
        self._output_sites = pipeline.graph.output_sites()  # calls whose result is (part of) the output
        self.waves = None if config.pipelining else Waves()
        self.calls: CallService | None = None  # takes the calls workers' components make to the components they hold
        self.inflight = 0
        self.inflight_bytes = 0  # of request bodies, from when each is read until its request ends (`hold_body`)
        self.outcomes: Counter[str] = Counter()  # requests by result: ok, error, worker_died, timeout, overloaded, cancelled
        self.slo_met = 0
        self.latency_buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)
        self.latency_sum_s = 0.0
        self.closing = False
        self._idle = asyncio.Event()
        self._idle.set()
        self.started = time.time()

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        """Build the queues, start every replica, then the autoscaler (when on); raises the first replica's start error."""
        specs = []
        resources = self._resources()
        handles = await self._start_handles()
        for name, component in self.components.items():
            settings = self.config.components[name]
            replica_set = self.sets[name] = ReplicaSet(name, self.config.max_inflight_batches, self.supervisor.recycle,
                                                       abandoned_grace_s=self.config.abandoned_grace_s)
            uid = component._patchkit_spec.uid
            for method, made in make_methods(type(component)).items():
                self.queues[uid, method] = BatchQueue(
                    replica_set,
                    method,
                    batch_size=settings.batch_sizes[method],
                    batch_wait_s=self.config.batch_wait_ms / 1000,
                    max_retries=self.config.max_retries if made.retries is None else made.retries,
                    timeout_s=made.timeout_s or self.config.call_timeout_s,
                    concurrency=_concurrency(made.max_concurrency, settings.batch_sizes[method]),
                    clock=self.clock,
                )
            device = settings.resource if self.config.plan is not None else None
            held = handles if handles is not None and constructor_components(component) else None
            specs += [
                ReplicaSpec(name, component, resources.pop(0), device, settings.units, held) for _ in range(settings.replicas)
            ]
        await self.supervisor.start(specs)
        if self.config.autoscale:
            self.autoscaler.start()

    async def _start_handles(self) -> Handles | None:
        """Where workers whose components hold components of this pipeline (a Grader given the `llm`) send
        those calls: a CallService started here, whose calls queue like the pipeline's own. Worker
        processes of the local backend only: a Ray actor, and the inprocess backend's replicas (the
        user's own objects, on this loop), run the components they hold in place."""
        if self.config.backend != "local" or not any(constructor_components(c) for c in self.components.values()):
            return None
        self.calls = CallService(self._call_held, self.config.secret)
        address = await self.calls.start()
        uids = frozenset(self._names)
        return Handles(address, uids, self.config.request_timeout_s)

    async def _call_held(self, uid: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
        """A worker's component called a component it holds: queue it as a pipeline call of that component."""
        queue = self.queues.get((uid, method))
        if queue is None:
            error = PatchkitError(f"no queue serves {self._names.get(uid, uid)}.{method}")
            return (False, Failure.verdict(error))
        prefix = _prefix_key(self.components[self._names[uid]], method, args, kwargs)
        return await queue.submit(args, kwargs, prefix=prefix).future

    def _resources(self) -> list[ReplicaResources]:
        """Each replica's pinning, in the order `start` creates them: placed as the plan says, else shared evenly."""
        total = sum(c.replicas for c in self.config.components.values())
        if self.config.backend == "inprocess":
            return [ReplicaResources() for _ in range(total)]
        if self.config.backend == "ray":  # Ray places them and sets their GPUs; only thread counts are ours
            placed = [self.config.components[name] for name in self.components]
            return [ReplicaResources(threads=_threads(c.resource, c.units)) for c in placed for _ in range(c.replicas)]
        if self.config.plan is not None:
            placed = [self.config.components[name] for name in self.components]
            return assign([(c.resource, c.units) for c in placed for _ in range(c.replicas)])
        return spread(total)

    async def close(self) -> None:
        """Refuse new requests and stop the autoscaler, wait for in-flight requests (up to the drain
        timeout), then stop every replica."""
        self.closing = True
        await self.autoscaler.close()
        self.prefetcher.close()
        try:
            await asyncio.wait_for(self._idle.wait(), self.config.drain_timeout_s)
        except TimeoutError:
            logger.warning("closing with %d requests still in flight after %.0f s", self.inflight, self.config.drain_timeout_s)
        await self.supervisor.close()
        if self.calls is not None:
            await self.calls.close()

    def _replica_up(self, replica: Replica) -> None:
        self.sets[replica.component].add(replica)

    def _replica_down(self, replica: Replica, reason: str) -> None:
        self.sets[replica.component].remove(replica)

    # -- requests -------------------------------------------------------------------------------
    def hold_body(self, size: int, held: int = 0) -> int:
        """Count a request body of `size` bytes in flight, in place of the `held` bytes counted for it
        so far; returns `size`, to be given back to `release_body` when the request ends.

        Called by the HTTP layer when a body's size is known: its Content-Length before it is read
        (a full endpoint refuses it unread), then its decoded size. Raises Overloaded when it would
        take the bytes in flight past `max_inflight_bytes`, so that the front-end never holds
        `max_inflight_requests x max_body_bytes`.
        """
        grow, limit = size - held, self.config.max_inflight_bytes
        if grow > 0 and self.inflight_bytes + grow > limit:
            self.outcomes["overloaded"] += 1
            raise Overloaded(self.inflight_bytes, limit, f"request bodies in flight hold {self.inflight_bytes} bytes; "
                             f"this one's {size} would pass max_inflight_bytes ({limit}); retry later")
        self.inflight_bytes += grow
        return size

    def release_body(self, held: int) -> None:
        """The request that `hold_body` counted `held` bytes for has ended."""
        self.inflight_bytes -= held

    async def query(
        self,
        inputs: dict[str, Any],
        slo_ms: float | None = None,
        *,
        request_id: str | None = None,
        on_delta: Callable[[str], None] | None = None,
    ) -> RequestResult:
        """Run the pipeline on inputs checked at the edge (`patchkit.server.inputs`); raises what the request should answer.

        `request_id`: the request's id (the client's X-Request-ID, checked at the edge), else a fresh
        one; it is in the result, in the request's log records (`REQUEST_ID`), traces and spans.
        `on_delta`: called on this loop with each text chunk of the calls whose result is the pipeline's
        output, or an item of it (`stream=True` methods the captured graph connects to the output), as
        they are made. Cancelling the query (its client went away) withdraws its queued calls and stops
        its running ones where they can stop; it counts as `cancelled`.
        """
        request_id = request_id if request_id is not None else new_request_id()
        token = REQUEST_ID.set(request_id)
        span = telemetry.start_request(request_id)
        outcome = "error"
        try:
            result = await self._query(inputs, slo_ms, request_id, span, on_delta)
            outcome = "ok"
            return result
        except DeadlineExceeded:
            outcome = "timeout"
            raise
        except Overloaded:
            outcome = "overloaded"
            raise
        except WorkerDiedError:
            outcome = "worker_died"
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            telemetry.end_request(span, outcome)
            REQUEST_ID.reset(token)

    async def _query(
        self,
        inputs: dict[str, Any],
        slo_ms: float | None,
        request_id: str,
        span: telemetry.Span,
        on_delta: Callable[[str], None] | None,
    ) -> RequestResult:
        if self.closing:
            raise Overloaded(self.inflight, 0, "the endpoint is shutting down")
        if self.inflight >= self.config.max_inflight_requests:
            self.outcomes["overloaded"] += 1
            raise Overloaded(self.inflight, self.config.max_inflight_requests)
        start = time.perf_counter()
        expires = asyncio.get_running_loop().time() + self.config.request_timeout_s
        variables = self.pipeline.variables(inputs)
        state = self.policy.start(request_id, inputs, slo_ms or self.config.slo_ms)
        self.inflight += 1
        self._idle.clear()
        ok = entered = False
        try:
            async with asyncio.timeout(self.config.request_timeout_s):
                await self.policy.admit(state)
                if self.waves is not None:
                    await self.waves.enter()
                    entered = True
                output = await run_sync(self._run, variables, _Request(state, expires, span, on_delta))
            ok = True
        except asyncio.CancelledError:
            self.outcomes["cancelled"] += 1
            raise
        except TimeoutError:
            self.outcomes["timeout"] += 1
            raise DeadlineExceeded(f"request {request_id} ran past request_timeout_s={self.config.request_timeout_s:g}") from None
        except Overloaded:
            self.outcomes["overloaded"] += 1
            raise
        except BaseException as exc:
            self.outcomes["worker_died" if isinstance(exc, WorkerDiedError) else "error"] += 1
            raise
        finally:
            if entered:
                assert self.waves is not None
                self.waves.leave()
            self.policy.finish(state, ok=ok)
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()
        latency = time.perf_counter() - start
        self._observe(latency, slo_ms or self.config.slo_ms)
        return RequestResult(request_id, output, latency)

    def _run(self, variables: dict[str, Any], request: _Request) -> Any:
        REQUEST_ID.set(request.state.id)  # the greenlet's own context: the request's log records carry its id
        with call_hook(functools.partial(self._call, request)):
            return self.pipeline.run(variables)

    def _call(
        self, request: _Request, component: Component, method: MakeMethod, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The call hook, inside a request's greenlet: queue the call and wait for its outcome.

        The request's calls are withdrawn when it ends (their futures are cancelled with it), and a
        worker does not run one past `request.expires`, the event loop's time when it times out."""
        uid = component._patchkit_spec.uid
        queue = self.queues.get((uid, method.name))
        if queue is None:
            # A component the pipeline creates as it runs has no workers: it runs here, off the loop.
            return await_(asyncio.to_thread(method.run_local, component, args, kwargs))
        name, state = self._names[uid], request.state
        site = None
        if (uid, method.name) in self.prefetcher.sources or (method.stream and request.on_delta is not None):
            site = site_of(sys._getframe(2))  # frame 1 is BoundMake.__call__, 2 the pipeline code making the call
        if (uid, method.name) in self.prefetcher.sources:
            self.prefetcher.on_call(component, method.name, site, args, kwargs)
        call_span, carrier = telemetry.start_call(request.span, name, method.name)
        submitted_ns, slack = time.time_ns(), None
        if state.deadline is not None:  # an SLO applies: estimate the slack, record the visit
            started = self.clock()
            slack = self.policy.check(state)
        on_chunk = request.on_delta if site is not None and site in self._output_sites else None
        prefix = _prefix_key(component, method.name, args, kwargs)
        call = queue.submit(args, kwargs, slack, request.expires, prefix=prefix, on_chunk=on_chunk, trace=carrier)
        ok, value = await_(call.future)
        if call_span is not None:
            dispatched_ns = None if call.dispatched is None else time.time_ns() - int((self.clock() - call.dispatched) * 1e9)
            telemetry.end_call(call_span, submitted_ns, dispatched_ns, None if ok else value.message)
        if state.deadline is not None:
            visit = Visit(f"{name}.{method.name}", name, started, self.clock(), _size(args), _size(value), call.waited)
            self.policy.record(state, visit)
        if ok:
            return value
        value.raise_for(name, method.name)

    def _submit_prefetch(self, uid: str, args: tuple[Any, ...]) -> asyncio.Future[Any]:
        return self.queues[uid, PREFETCH_METHOD].submit(args, {}).future

    def _observe(self, latency_s: float, slo_ms: float | None) -> None:
        self.outcomes["ok"] += 1
        self.latency_sum_s += latency_s
        bucket = next((i for i, bound in enumerate(LATENCY_BUCKETS_S) if latency_s <= bound), len(LATENCY_BUCKETS_S))
        self.latency_buckets[bucket] += 1
        if slo_ms is not None and latency_s * 1000 <= slo_ms:
            self.slo_met += 1

    # -- views ----------------------------------------------------------------------------------
    def healthy(self) -> bool:
        """Whether every component has a healthy replica (alive, serving, its last health check passed): `/healthz`."""
        return all(any(r.healthy for r in s.replicas) for s in self.sets.values())

    def snapshot(self) -> FrontendSnapshot:
        """The counters at this moment, for `/metrics` and `stats()`."""
        now = time.monotonic()
        methods = tuple(
            MethodSnapshot(
                name, queue.method, queue.batch_size, len(queue), queue.stats.calls, queue.stats.batches,
                queue.stats.failures, queue.stats.retries, queue.stats.queue_wait_s, queue.stats.service_s,
                queue.stats.throughput(now),
            )
            for name, replica_set in self.sets.items()
            for queue in replica_set.queues
        )
        return FrontendSnapshot(
            outcomes=dict(self.outcomes), inflight=self.inflight, slo_met=self.slo_met,
            latency_buckets=tuple(self.latency_buckets), latency_sum_s=self.latency_sum_s, methods=methods,
            live_replicas={name: sum(r.alive for r in s.replicas) for name, s in self.sets.items()},
            replica_components={replica.id: replica.component for replica in self.supervisor.replicas()},
            replica_states={r.id: (r.component, r.state) for r in [*self.supervisor.replicas(), *self.supervisor.replacing()]},
            restarts=self.supervisor.restarts, slo=self.policy.stats(), prefetch=self.prefetcher.stats(),
        )

    def stats(self) -> dict[str, Any]:
        """Per component: replicas, per method batch size, throughput and queue, and the replicas replaced
        lately (dead, stuck, unhealthy) with why; called by /v1/stats."""
        snapshot = self.snapshot()
        components: dict[str, dict[str, Any]] = {
            name: {"class": type(component).__name__, "replicas": self._replicas(name), "methods": {},
                   "replaced": [r.describe() for r in self.supervisor.replaced if r.component == name]}
            for name, component in self.components.items()
        }
        for method in snapshot.methods:
            components[method.component]["methods"][method.method] = method.describe()
        requests: dict[str, float] = {"inflight": snapshot.inflight, **snapshot.outcomes}
        if snapshot.outcomes.get("ok"):
            requests["mean_latency_ms"] = 1000 * snapshot.latency_sum_s / snapshot.outcomes["ok"]
        return {"backend": self.config.backend, "uptime_s": time.time() - self.started, "requests": requests,
                "restarts": snapshot.restarts, "slo": dict(snapshot.slo), "prefetch": dict(snapshot.prefetch),
                "components": components}

    def _replicas(self, name: str) -> list[dict[str, Any]]:
        """The component's replicas in service, then those out of it until another replaces each (dead, stuck,
        unhealthy), with their `state` and `why`."""
        return [r.describe() for r in [*self.sets[name].replicas, *self.supervisor.replacing(name)]]

    async def replica_stats(self) -> dict[str, Any]:
        """What each replica reports about itself (pid, pinning, batches run, its component's own
        stats()), asked of all at once; a replica that cannot answer reports its error."""
        replicas = list(self.supervisor.replicas())
        reports = await asyncio.gather(*(replica.channel.stats() for replica in replicas), return_exceptions=True)
        return {
            replica.id: {"error": str(report)} if isinstance(report, BaseException) else report
            for replica, report in zip(replicas, reports)
        }


@dataclass(frozen=True)
class _Request:
    """What a request's component calls need of it: its SLO state, when it times out (the event loop's
    time), its span, and where the chunks of its output go when it streams."""

    state: RequestState
    expires: float
    span: telemetry.Span
    on_delta: Callable[[str], None] | None


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


def _size(value: Any) -> int:
    """A cheap size of a call's input or output for the estimators: the length of a string or collection."""
    if isinstance(value, tuple) and len(value) == 1:
        value = value[0]
    return len(value) if isinstance(value, (str, list, tuple, dict)) else 1


def make_backend(config: DeploymentConfig) -> Backend:
    if config.backend == "inprocess":
        return InProcessBackend()
    if config.backend == "ray":
        from patchkit.orchestrator.ray_backend import RayBackend  # imports nothing of Ray until it connects

        return RayBackend(config.secret, config.ray_options(), gpu_units=_gpu_units(config))
    return LocalBackend(config.secret, host="127.0.0.1")


def _threads(resource: str, units: int) -> int:
    """A replica's threads: as its CPU shares give it (a core each, or 1 on a shared core); 1 for a GPU replica."""
    return cpu_threads(units) if resource == "cpu" else 1


def _gpu_units(config: DeploymentConfig) -> int:
    """GPU units the plan gives all replicas together; the Ray backend shares GPUs when the cluster has fewer."""
    if config.plan is None:
        return 0
    return sum(c.replicas * c.units for c in config.components.values() if c.resource == "gpu")
