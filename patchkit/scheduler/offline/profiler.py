"""Profiler: how each component's batch latency grows with the batch size, per resource type and thread count.

Called by `plan()`. Each (component, resource type) runs in a worker process of its own, pinned as
a replica of the plan would be (one GPU, or on CPU one core with one thread), and is driven through
the same gRPC channel the front-end uses, so the numbers include the process hop. Its inputs are
the distinct calls the calibration runs recorded; a component that several pipelines of a deployment
call is profiled once, with the calls of all of them (`workload`). Batch sizes are searched as
Patchwork (section 3.3) does: the largest that fits (halving past a MemoryError), 1, then a binary
search towards the knee, going lower while the larger batch's throughput gain stays under
`threshold`. Every size runs the same mix of recorded calls (the first `MIX_CALLS`, or all, in as
many batches as it takes) and T(b) is the time per batch: calls that differ in cost weigh the same
at every size.

A method with `@make(max_concurrency=N)` is not batched by the front-end: it runs each call alone,
up to N at once per replica. Its sizes are therefore concurrency levels c in [1, N]: measuring c
sends one-call batches over the channel, c in flight at a time, and T(c) is the time per c calls.
An engine that batches by itself and opts into its cost model (`engine_profile`) is not searched:
a few short calls fit the model, whole calls check it, and the model predicts T(c) at every level.

A component that holds others (a Grader given the pipeline's `llm`) calls them, deployed, on their
own replicas; profiled, its calls of them are answered with what they answered in calibration
(`replay`), so that its profile is its own work.

On CPU every component is profiled at 1 thread first. One that could be the bottleneck (at 1
thread it serves fewer requests/s than the slowest component could on the whole pool) is then
profiled again at 2, 4, ... threads pinned to as many cores (up to the cores of the machine and of
the pool), in a fresh worker each time, while each count's best calls/s beats the previous count's
by `threshold` or more. The others keep their 1-thread profile: more threads for them could never
raise the pipeline's throughput. Profiles are cached on disk (`cache`): a second plan of the same
pipeline and calibration starts no worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import secrets
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from patchkit.capture.holders import constructor_components
from patchkit.capture.recorder import CallRecord
from patchkit.core import Call, Component, make_methods
from patchkit.errors import ComponentError, PlanError
from patchkit.orchestrator.backend import Replica, ReplicaSpec
from patchkit.orchestrator.local import LocalBackend
from patchkit.orchestrator.resources import ReplicaResources, available_cpus, available_gpus
from patchkit.scheduler.offline.ahead import Ahead
from patchkit.scheduler.offline.cache import ProfileCache, digest
from patchkit.scheduler.offline.engine_profile import EngineProfile, opts_in
from patchkit.scheduler.offline.pool import ResourcePool
from patchkit.scheduler.offline.profiles import ComponentProfile, MethodProfile
from patchkit.scheduler.offline.progress import Progress
from patchkit.scheduler.offline.replay import Replay
from patchkit.scheduler.offline.runs import check_outcomes, timed
from patchkit.scheduler.offline.stand_ins import stand_ins
from patchkit.scheduler.offline.workload import Workload, visits_by_component

if TYPE_CHECKING:
    from patchkit.program.pipeline import Pipeline  # the top layer: a type only

__all__ = ["ComponentProfile", "MethodProfile", "Profiler", "thread_counts", "visits_by_component"]

logger = logging.getLogger(__name__)

MAX_POINTS = 8  # batch sizes (or concurrency levels) measured per method and resource type
INPUTS_PER_METHOD = 64  # distinct recorded calls kept to build batches from (cycled)
MIX_CALLS = 16  # recorded calls every size runs at least (in as many batches as it takes): the same mix at each size
START_S = 4.0  # a worker's start, estimated until one has been timed
HELD_CALL_S = 0.002  # a holder's own work per call, estimated (its held calls are replayed)
SEARCH_CALLS = 256  # calls a batch-size search runs, about, for the estimate of the time left
ENGINE_CALLS = 2.0  # an engine's profile runs each distinct call about this many times, in time


@dataclass(frozen=True)
class _Job:
    """One component on one resource type, with the distinct recorded calls and visits of the methods it runs."""

    name: str
    component: Component
    resource: str
    calls: dict[str, list[Call]]
    visits: dict[str, float]
    threads: int = 1
    holds: bool = False  # it calls components of the pipeline that it was given: replayed
    seconds: dict[str, list[float]] = dataclasses.field(default_factory=dict)  # its calls' in the eager runs
    stand_ins: dict[str, str] = dataclasses.field(default_factory=dict)  # where a method's inputs came from, when not calibration
    core: int = 0  # the first of the cores it is pinned to, among this process's

    @property
    def label(self) -> str:
        if self.resource != "cpu":
            return f"{self.name} on {self.resource}"
        return f"{self.name} on cpu, {self.threads} thread{'s' * (self.threads > 1)}"


class Profiler:
    """Measures T(b) of every (component, resource type) a plan may choose. Called by `plan()`."""

    def __init__(self, pool: ResourcePool, *, repeats: int = 3, threshold: float = 0.1, progress: bool = True) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1; got {repeats}")
        self.pool, self.repeats, self.threshold, self.progress = pool, repeats, threshold, progress
        self.cache = ProfileCache()
        self._start_times: list[float] = []

    def run(self, pipelines: Workload | Pipeline, records: Sequence[CallRecord] | None = None) -> list[ComponentProfile]:
        """Profile every component the calibration called; blocks (on an event loop of its own).

        `pipelines`: one pipeline, or the `Workload` of several, whose components are profiled once
        each, by their deployed names, with the calls of every pipeline that calls them. `records`: the
        calls to profile with (default: every call the pipelines recorded). One profile per (component,
        resource type), and on CPU one more per thread count that paid off.
        """
        workload = pipelines if isinstance(pipelines, Workload) else Workload.of(pipelines)
        records = list(workload.recorded() if records is None else records)
        jobs = self._jobs(workload, records)
        progress = Progress(enabled=self.progress)
        try:
            profiles: list[ComponentProfile] = _run_async(self._profile_all(workload, jobs, records, progress))
        finally:
            progress.close()
        return profiles

    def _jobs(self, workload: Workload, records: list[CallRecord]) -> list[_Job]:
        calls, seconds = _recorded_calls(workload, records)
        components = workload.components
        shared = {c._patchkit_spec.uid for c in components.values()}
        jobs = []
        for name, methods in workload.visits().items():
            called = {method: v for method, v in methods.items() if v}
            if not called:
                continue  # never called on any run: nothing to measure it with, and no share of the requests
            component = components[name]
            missing = [m for m in called if not calls.get((name, m))]
            sources = stand_ins(component, name, missing, [*records, *workload.recorded()], workload.names_by_uid())
            for method, found in sources.items():
                calls[name, method], seconds[name, method] = found.calls, found.seconds
            holds = any(inner._patchkit_spec.uid in shared for _, inner in constructor_components(component))
            eager = {m: [HELD_CALL_S] * len(seconds[name, m]) if holds else seconds[name, m] for m in called}
            given = {m: found.source for m, found in sources.items()}
            for kind in component.devices:
                if self.pool.capacity.get(kind, 0) > 0:
                    jobs.append(_Job(name, component, kind, {m: calls[name, m] for m in called}, called, 1, holds, eager,
                                     given))
        return jobs

    async def _profile_all(
        self, workload: Workload, jobs: list[_Job], records: list[CallRecord], progress: Progress
    ) -> list[ComponentProfile]:
        """Every job at 1 thread, then more threads for those that could be the bottleneck."""
        secret = secrets.token_urlsafe(16)
        backend = LocalBackend(secret)
        held = {c._patchkit_spec.uid: c for c in workload.components.values()}
        replay = Replay([*records, *workload.recorded()], held, secret)  # stand-in inputs' held calls too
        try:
            for job in jobs:
                progress.expect(job.label, self._estimate(job))
            first, ahead = [], Ahead()
            try:
                for i, job in enumerate(jobs):
                    following = self._overlapping(job, jobs[i + 1]) if i + 1 < len(jobs) else None
                    jobs[i + 1 : i + 2] = [following] if following is not None else jobs[i + 1 : i + 2]
                    first.append(await self._profile(backend, replay, job, progress, ahead=ahead, following=following))
            finally:
                await ahead.drop(backend)
            bound = _throughput_bound(first, self.pool)
            profiles = []
            for job, profile in zip(jobs, first):
                profiles.append(profile)
                if job.resource == "cpu" and _could_bottleneck(profile, bound, self.threshold):
                    profiles += await self._more_threads(backend, replay, job, profile, progress)
            if replay.ran:
                logger.info("held calls replayed: %d; run here (not recorded): %d", replay.replayed, replay.ran)
            return profiles
        finally:
            await replay.close()
            await backend.close()

    async def _more_threads(
        self, backend: LocalBackend, replay: Replay, job: _Job, first: ComponentProfile, progress: Progress
    ) -> list[ComponentProfile]:
        """The job at each further thread count while it speeds up by `threshold`."""
        profiles, previous = [], first
        for threads in thread_counts(min(len(available_cpus()), self.pool.capacity.get("cpu", 0)))[1:]:
            more = dataclasses.replace(job, threads=threads, core=0)
            progress.expect(more.label, self._estimate(more, previous))
            profile = await self._profile(backend, replay, more, progress, previous)
            gain = profile.best_rate() / previous.best_rate() - 1
            if not gain >= self.threshold:  # nan too: no rate to compare
                logger.info("%s: %d threads serve %.2fx the calls/s of %d; profiled no further", job.name, threads,
                            1 + gain, previous.threads)
                break
            profiles.append(profile)
            previous = profile
        return profiles

    async def _profile(
        self, backend: LocalBackend, replay: Replay, job: _Job, progress: Progress, fewer: ComponentProfile | None = None,
        *, ahead: Ahead | None = None, following: _Job | None = None,
    ) -> ComponentProfile:
        """One job's profile: from the cache, or measured in a worker started for it (or `ahead` of it). `fewer`:
        the component's profile at the previous thread count, when this one is at more threads. `following`:
        the next job, whose worker starts `ahead` on another core once this one's is up."""
        progress.begin(job.label)
        found = {method: self.cache.load(self._key(job, method), method) for method in job.calls}
        measured = any(profile is None for profile in found.values())
        replica = None
        try:
            for method, profile in found.items():
                if profile is None:
                    if replica is None:
                        replica = await ahead.take(job) if ahead is not None else None
                        replica = replica or await self._start(backend, replay, job, progress)
                        if ahead is not None and following is not None:
                            ahead.begin(following, self._start(backend, replay, following, progress, quiet=True))
                    found[method] = profile = await self._measure(replica, job, method, progress, fewer)
                    self.cache.store(self._key(job, method), profile)
        finally:
            if replica is not None:
                await backend.stop(replica)
        methods = {m: p for m, p in found.items() if p is not None}
        result = ComponentProfile(job.name, job.resource, methods, job.visits, job.threads)
        progress.done(job.label, f"{job.label}: {_summary(result)}", measured=measured)
        return result

    async def _start(self, backend: LocalBackend, replay: Replay, job: _Job, progress: Progress, quiet: bool = False) -> Replica:
        if not quiet:
            progress.note(f"{job.label}: starting a worker")
        handles = await replay.handles() if job.holds else None
        spec = ReplicaSpec(job.name, job.component, self._resources(job.resource, job.threads, job.core), handles=handles)
        began = time.perf_counter()
        replica = await backend.start(spec, f"profile-{job.name}")
        self._start_times.append(time.perf_counter() - began)
        return replica

    async def _measure(
        self, replica: Replica, job: _Job, method: str, progress: Progress, fewer: ComponentProfile | None
    ) -> MethodProfile:
        concurrency = _max_concurrency(job.component, method)
        try:
            if concurrency is not None and opts_in(job.component, concurrency):
                engine = EngineProfile(replica, job.name, job.component, method, job.calls[method], concurrency, progress.note)
                profile = await engine.run(fewer.methods.get(method) if fewer is not None else None, self.threshold)
                _log_model(job, profile)
                return profile
            return await self._search(replica, job, method, progress)
        except ComponentError as exc:
            if method not in job.stand_ins:
                raise
            raise PlanError(f"{job.name}.{method} failed on {job.stand_ins[method]}, with which it was profiled since the "
                            f"calibration inputs never reached it: {exc}; pass calibration inputs that reach it") from exc

    def _resources(self, kind: str, threads: int, core: int = 0) -> ReplicaResources:
        """One GPU, or `threads` cores with a thread each (from the `core`-th), as a replica of the plan gets them."""
        if kind == "gpu":
            gpus = available_gpus()
            return ReplicaResources(threads=1, gpus=tuple(gpus[:1]))  # none: a virtual GPU
        cpus = available_cpus()
        chosen = cpus[core : core + threads] if core + threads <= len(cpus) else cpus[:threads]
        return ReplicaResources(cpus=tuple(chosen), threads=threads, gpus=())

    def _overlapping(self, job: _Job, following: _Job) -> _Job | None:
        """`following` pinned to another core than `job`, when its worker may start while `job` is measured
        (both measured, on one core each, of two or more): a start then costs no time of its own, and
        runs on a core no measurement uses. None where it may not."""
        one_core = all(j.resource == "cpu" and j.threads == 1 for j in (job, following))
        if not one_core or len(available_cpus()) < 2 or self._cached(job) or self._cached(following):
            return None
        if any(opts_in(job.component, _max_concurrency(job.component, m)) for m in job.calls):
            return None  # an engine's cost model is fitted on few runs: nothing starts beside them
        return dataclasses.replace(following, core=1 - job.core)

    def _cached(self, job: _Job) -> bool:
        return all(self.cache.path(self._key(job, m)).exists() for m in job.calls)

    async def _search(self, replica: Replica, job: _Job, method: str, progress: Progress) -> MethodProfile:
        """Measure T(b) at the sizes the search visits, from the largest that fits downwards.

        A size is a batch of b calls, or, for a `max_concurrency` method, b one-call batches in flight at a time."""
        name, calls = job.name, job.calls[method]
        concurrency = _max_concurrency(job.component, method)
        unit = "calls at once" if concurrency else "batch"
        measured: dict[int, float] = {}

        async def measure(size: int) -> float | None:
            rounds = -(-min(len(calls), MIX_CALLS) // size)  # every size runs the same mix of recorded calls
            batch = [calls[i % len(calls)] for i in range(rounds * size)]
            progress.note(f"{name}.{method}: {unit} {size}, {job.threads} thread(s)")
            times = []
            for _ in range(self.repeats + 1):  # the first run warms caches up and is not counted
                elapsed, outcomes = await timed(replica, method, batch, size, concurrent=concurrency is not None)
                if check_outcomes(name, method, outcomes, f"at {unit} {size}") is not None:
                    return None
                times.append(elapsed / rounds)
            measured[size] = statistics.median(times[1:])
            return measured[size]

        high = job.component.batch_limit(method)  # what the instance takes: a batch, or calls at once
        if concurrency is not None:
            high = min(high, concurrency)
        while high > 1 and await measure(high) is None:
            high //= 2
        await measure(1)
        if 1 not in measured:
            raise PlanError(f"{name}.{method} runs out of memory at batch size 1 while being profiled")
        low = 1
        while high - low > 1 and len(measured) < MAX_POINTS:
            middle = (low + high) // 2
            if await measure(middle) is None:
                high = middle
                continue
            gain = (high / measured[high]) / (middle / measured[middle]) - 1
            low, high = (low, middle) if gain < self.threshold else (middle, high)
        top = max(measured)
        return MethodProfile(method, tuple(sorted(measured.items())), top)

    def _key(self, job: _Job, method: str) -> tuple[Any, ...]:
        """What a method's profile depends on: see `cache`."""
        concurrency = _max_concurrency(job.component, method)
        if concurrency is not None and opts_in(job.component, concurrency):
            how: tuple[Any, ...] = ("cost model", 6)
        else:
            how = ("search", self.repeats, self.threshold, MIX_CALLS, MAX_POINTS)
        where = (job.resource, job.threads, "held calls replayed" if job.holds else "")
        return (job.component, method, where, ("calls at once", concurrency), how, job.calls[method])

    def _estimate(self, job: _Job, fewer: ComponentProfile | None = None) -> float:
        """Seconds the job's profile may take, for the time left: 0 when the cache has it. From its calls'
        eager times: a search runs about SEARCH_CALLS of its quickest; an engine runs each distinct call
        about ENGINE_CALLS times (half as often at a further thread count)."""
        if self._cached(job):
            return 0.0
        total = statistics.mean(self._start_times) if self._start_times else START_S
        for method, seconds in job.seconds.items():
            if opts_in(job.component, _max_concurrency(job.component, method)):
                total += ENGINE_CALLS * len(seconds) * statistics.median(seconds) * (0.5 if fewer is not None else 1.0)
            else:  # the first call's time may hold the component's setup: the quickest is the call's own
                total += SEARCH_CALLS * min(seconds)
        return total


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4, ... and `cores` itself: the thread counts a CPU component is profiled at, at most."""
    counts = [1]
    while counts[-1] * 2 < cores:
        counts.append(counts[-1] * 2)
    return counts + [cores] if cores > 1 else counts


Calls = dict[tuple[str, str], list[Call]]  # per (component, method)


def _recorded_calls(workload: Workload, records: list[CallRecord]) -> tuple[Calls, dict[tuple[str, str], list[float]]]:
    """Per (component, method), by deployed name, its distinct recorded calls in order (at most
    INPUTS_PER_METHOD), and their seconds."""
    calls: dict[tuple[str, str], list[Call]] = {}
    seconds: dict[tuple[str, str], list[float]] = {}
    seen: set[str] = set()
    names = workload.names_by_uid()
    for record in records:
        name = names.get(record.component._patchkit_spec.uid)
        if name is None:
            continue
        kept = calls.setdefault((name, record.method), [])
        key = digest((name, record.method, record.args, record.kwargs))
        if len(kept) < INPUTS_PER_METHOD and key not in seen:
            seen.add(key)
            kept.append((record.args, record.kwargs))
            seconds.setdefault((name, record.method), []).append(record.seconds)
    return calls, seconds


def _throughput_bound(profiles: list[ComponentProfile], pool: ResourcePool) -> float:
    """Requests/s no plan on `pool` can pass: the slowest component's, with every unit of its resource
    type running 1-thread replicas of it (more threads per replica speed a component up less than
    more replicas on as many cores)."""
    best: dict[str, float] = {}
    for profile in profiles:
        visits = sum(profile.visits.values())
        rate = pool.capacity.get(profile.resource, 0) * profile.best_rate() / visits if visits else math.inf
        best[profile.component] = max(best.get(profile.component, 0.0), rate)
    return min(best.values(), default=math.inf)


def _could_bottleneck(profile: ComponentProfile, bound: float, threshold: float) -> bool:
    """Whether one 1-thread replica of the component serves fewer requests/s than `bound`, by more than `threshold`."""
    visits = sum(profile.visits.values())
    return visits > 0 and profile.best_rate() / visits < bound * (1 + threshold)


def _summary(profile: ComponentProfile) -> str:
    parts = []
    for method, m in profile.methods.items():
        sizes = f"{m.points[0][0]}-{m.points[-1][0]}"
        if m.model is not None and "stopped" in m.model:
            parts.append(f"{method}: {m.model['stopped']}")
        elif m.model is not None:
            costs = m.model["costs"]
            parts.append(f"{method}: cost model, {costs['prompt_tokens_per_s']:.0f} prompt tokens/s, "
                         f"within {100 * m.model['error']:.1f}% of measured whole calls")
        else:
            parts.append(f"{method}: {sizes} measured")
    return "; ".join(parts)


def _log_model(job: _Job, profile: MethodProfile) -> None:
    assert profile.model is not None
    if "stopped" in profile.model:
        logger.info("%s.%s, %d threads: %s", job.name, profile.method, job.threads, profile.model["stopped"])
        return
    costs, checked = profile.model["costs"], profile.model["checks"]
    steps = ", ".join(f"{ms:.1f} ms at {k:.1f}" for k, ms in costs["step_ms"])
    checks = ", ".join(f"{what}: {c['predicted_ms']:.0f} ms predicted, {c['measured_ms']:.0f} measured"
                       for what, c in checked.items())
    logger.info("%s.%s, %d thread(s): prompt %.0f tokens/s, decode step %s, %.1f ms a call beyond the engine; "
                "whole calls %s", job.name, profile.method, job.threads, costs["prompt_tokens_per_s"],
                steps, costs["call_ms"], checks)


def _max_concurrency(component: Component, method: str) -> int | None:
    """The method's `@make(max_concurrency=...)`: None for a method the front-end batches."""
    return make_methods(type(component))[method].max_concurrency


def _run_async(coroutine: Any) -> Any:
    """Run on a fresh event loop, in a thread when this one already runs a loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="patchkit-profile") as pool:
        return pool.submit(asyncio.run, coroutine).result()
