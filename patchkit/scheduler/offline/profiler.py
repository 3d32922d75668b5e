"""Profiler: how each component's batch latency grows with the batch size, per resource type and thread count.

Called by `plan()`. Each (component, resource type) runs in a worker process of its own, pinned as
a replica of the plan would be (one GPU, or on CPU one core with one thread), and is driven through
the same gRPC channel the front-end uses, so the numbers include the process hop. Its inputs are
the calls the eager runs recorded. Batch sizes are searched as Patchwork (section 3.3) does: the
largest that fits (halving past a MemoryError), 1, then a binary search towards the knee, going
lower while the larger batch's throughput gain stays under `threshold`. Every size runs the same
mix of recorded calls (the first `MIX_CALLS`, or all, in as many batches as it takes) and T(b) is
the time per batch: calls that differ in cost (an LLM's 4-token grades and 64-token answers) weigh
the same at every size, rather than batch 1 timing the first call alone.

A method with `@make(max_concurrency=N)` (an engine batching concurrent calls itself) is not batched
by the front-end: it runs each call alone, up to N at once per replica. Its sizes are therefore
concurrency levels c in [1, N]: measuring c sends one-call batches over the channel, c in flight at
a time, and T(c) is the time per c calls. The search is the same; only how a size runs and its
upper bound differ. c calls in T(c) is a batch's throughput, so the fit and the MILP read it as one.

On CPU a component is profiled again at 2, 4, ... threads pinned to as many cores (up to the cores
of the machine and of the pool), in a fresh worker each time, while each count's best calls/s beats
the previous count's by `threshold` or more: a component that does not scale with threads (a BM25
search, a sleep) keeps only its 1-thread profile. Results are cached on disk, keyed by the
component's class and constructor arguments, the method, the resource type, the thread count, the
inputs, and whether sizes were batches or concurrency levels.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import math
import secrets
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cloudpickle

from patchkit import envs
from patchkit.component import Call, Component, make_methods
from patchkit.errors import ComponentError, PlanError
from patchkit.orchestrator.backend import Replica, ReplicaSpec
from patchkit.orchestrator.execute import Failure, Outcome
from patchkit.orchestrator.local import LocalBackend
from patchkit.orchestrator.resources import ReplicaResources, available_cpus, available_gpus
from patchkit.scheduler.offline.pool import ResourcePool
from patchkit.scheduler.offline.pwl import PiecewiseLinear

if TYPE_CHECKING:
    from patchkit.client.pipeline import Pipeline  # the top layer: a type only

__all__ = ["ComponentProfile", "MethodProfile", "Profiler", "thread_counts", "visits_by_component"]

logger = logging.getLogger(__name__)

MAX_POINTS = 8  # batch sizes (or concurrency levels) measured per method and resource type
INPUTS_PER_METHOD = 64  # recorded calls kept to build batches from (cycled)
MIX_CALLS = 16  # recorded calls every size runs at least (in as many batches as it takes): the same mix at each size


@dataclass(frozen=True)
class MethodProfile:
    method: str
    points: tuple[tuple[int, float], ...]  # (batch size or calls at once, median ms per batch of that many), ascending
    max_batch: int  # the largest batch (or concurrency level) that ran (memory-bounded)


@dataclass(frozen=True)
class ComponentProfile:
    """One component on one resource type at one thread count: its methods' curves and their share of its calls."""

    component: str
    resource: str
    methods: dict[str, MethodProfile]
    visits: dict[str, float]  # calls per request, per method
    threads: int = 1  # threads the replica ran with, pinned to as many cores (on "gpu": 1)

    @property
    def max_batch(self) -> int:
        return min(m.max_batch for m in self.methods.values())

    def latency(self) -> PiecewiseLinear:
        """ms per batch of the component's call mix: its methods' fitted curves weighted by their visits."""
        curves = {name: PiecewiseLinear.fit(m.points) for name, m in self.methods.items()}
        total = sum(self.visits[name] for name in curves)
        sizes = sorted({b for curve in curves.values() for b in curve.breakpoints} | {1, self.max_batch})
        sizes = [b for b in sizes if 1 <= b <= self.max_batch]
        values = [sum(self.visits[name] / total * curve(b) for name, curve in curves.items()) for b in sizes]
        return PiecewiseLinear(tuple(float(b) for b in sizes), tuple(values))

    def best_rate(self) -> float:
        """Calls/s of one replica at its best batch size: what more threads must raise to be worth profiling."""
        curve = self.latency()
        return max(b / curve(b) for b in curve.breakpoints if curve(b) > 0) * 1000 if any(curve.values) else math.inf

    def to_dict(self) -> dict[str, Any]:
        return {name: {"points": [list(p) for p in m.points], "max_batch": m.max_batch} for name, m in self.methods.items()}


def visits_by_component(pipeline: Pipeline) -> dict[str, dict[str, float]]:
    """Calls per request of each component's methods, averaged over the eager runs (branches, loops)."""
    visits: dict[str, dict[str, float]] = {name: {} for name in pipeline.components}
    per_node = pipeline.graph.visits_per_run()
    for node in pipeline.graph.nodes.values():
        methods = visits.setdefault(node.component, {})
        methods[node.method] = methods.get(node.method, 0.0) + per_node[node.id]
    return visits


@dataclass(frozen=True)
class _Job:
    """One component on one resource type, with the recorded calls and visits of the methods it runs."""

    name: str
    component: Component
    resource: str
    calls: dict[str, list[Call]]
    visits: dict[str, float]
    threads: int = 1


class Profiler:
    """Measures T(b) of every (component, resource type) a plan may choose. Called by `plan()`."""

    def __init__(self, pool: ResourcePool, *, repeats: int = 3, threshold: float = 0.1, progress: bool = True) -> None:
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1; got {repeats}")
        self.pool, self.repeats, self.threshold, self.progress = pool, repeats, threshold, progress
        self.cache = envs.cache_dir() / "profiles"

    def run(self, pipeline: Pipeline) -> list[ComponentProfile]:
        """Profile every component the eager runs called; blocks (on an event loop of its own).

        One profile per (component, resource type), and on CPU one more per thread count that paid off.
        """
        jobs = self._jobs(pipeline)
        with _Progress(len(jobs), enabled=self.progress) as progress:
            return _run_async(self._profile_all(jobs, progress))

    def _jobs(self, pipeline: Pipeline) -> list[_Job]:
        calls = _recorded_calls(pipeline)
        jobs = []
        for name, methods in visits_by_component(pipeline).items():
            called = {method: v for method, v in methods.items() if v}
            if not called:
                continue  # never called on the calibration inputs: nothing to measure it with
            missing = [method for method in called if not calls.get((name, method))]
            if missing:
                raise PlanError(
                    f"no recorded inputs for {name}.{missing[0]}: run the capture eagerly (capture(run=True)) "
                    "or pass calibration=[{...}, ...] inputs to plan() or deploy()"
                )
            component = pipeline.components[name]
            for kind in component.devices:
                if self.pool.capacity.get(kind, 0) > 0:
                    jobs.append(_Job(name, component, kind, {m: calls[name, m] for m in called}, called))
        return jobs

    async def _profile_all(self, jobs: list[_Job], progress: _Progress) -> list[ComponentProfile]:
        backend = LocalBackend(secrets.token_urlsafe(16))
        try:
            return [profile for job in jobs for profile in await self._profile_threads(backend, job, progress)]
        finally:
            await backend.close()

    async def _profile_threads(self, backend: LocalBackend, job: _Job, progress: _Progress) -> list[ComponentProfile]:
        """The job at 1 thread, then, on CPU, at each further count while it speeds up by `threshold`."""
        profiles = [await self._profile(backend, job, progress)]
        if job.resource != "cpu":
            progress.done(f"{job.name} on {job.resource}")
            return profiles
        for threads in thread_counts(min(len(available_cpus()), self.pool.capacity.get("cpu", 0)))[1:]:
            profile = await self._profile(backend, dataclasses.replace(job, threads=threads), progress)
            gain = profile.best_rate() / profiles[-1].best_rate() - 1
            if not gain >= self.threshold:  # nan too: no rate to compare
                logger.info("%s: %d threads serve %.2fx the calls/s of %d; profiled no further", job.name, threads,
                            1 + gain, profiles[-1].threads)
                break
            profiles.append(profile)
        progress.done(f"{job.name} on cpu, up to {profiles[-1].threads} threads")
        return profiles

    async def _profile(self, backend: LocalBackend, job: _Job, progress: _Progress) -> ComponentProfile:
        found = {method: self._load(job, method) for method in job.calls}
        replica = None
        try:
            for method, profile in found.items():
                if profile is None:
                    if replica is None:
                        spec = ReplicaSpec(job.name, job.component, self._resources(job.resource, job.threads))
                        replica = await backend.start(spec, f"profile-{job.name}")
                    found[method] = profile = await self._search(replica, job, method, progress)
                    self._store(job, method, profile)
        finally:
            if replica is not None:
                await backend.stop(replica)
        methods = {m: p for m, p in found.items() if p is not None}
        return ComponentProfile(job.name, job.resource, methods, job.visits, job.threads)

    def _resources(self, kind: str, threads: int) -> ReplicaResources:
        """One GPU, or `threads` cores with a thread each, as a replica of the plan gets them."""
        if kind == "gpu":
            gpus = available_gpus()
            return ReplicaResources(threads=1, gpus=tuple(gpus[:1]))  # none: a virtual GPU
        return ReplicaResources(cpus=tuple(available_cpus()[:threads]), threads=threads, gpus=())

    async def _search(self, replica: Replica, job: _Job, method: str, progress: _Progress) -> MethodProfile:
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
                elapsed, outcomes = await _timed(replica, method, batch, size, concurrent=concurrency is not None)
                failed = next((value for ok, value in outcomes if not ok), None)
                if isinstance(failed, Failure):
                    if _out_of_memory(failed):
                        return None
                    message = f"failed while being profiled at {unit} {size}: {failed.type_name}: {failed.message}"
                    raise ComponentError(name, method, message, failed.traceback)
                times.append(elapsed / rounds)
            measured[size] = statistics.median(times[1:])
            return measured[size]

        high = concurrency or job.component.batch_limit(method)
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

    # -- the on-disk cache -----------------------------------------------------------------------
    def _path(self, job: _Job, method: str) -> Path:
        spec = job.component._patchkit_spec
        where = (job.resource, job.threads)
        sizes = ("calls at once", _max_concurrency(job.component, method))  # None: sizes are batches
        identity = (spec.cls.__module__, spec.cls.__qualname__, spec.args, spec.kwargs, method, where, sizes, job.calls[method])
        key = hashlib.sha256(cloudpickle.dumps((identity, self.repeats, self.threshold, MIX_CALLS))).hexdigest()[:24]
        return self.cache / f"{key}.json"

    def _load(self, job: _Job, method: str) -> MethodProfile | None:
        path = self._path(job, method)
        try:
            data = json.loads(path.read_text())
            return MethodProfile(method, tuple((int(b), float(ms)) for b, ms in data["points"]), int(data["max_batch"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def _store(self, job: _Job, method: str, profile: MethodProfile) -> None:
        self.cache.mkdir(parents=True, exist_ok=True)
        path = self._path(job, method)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"points": [list(p) for p in profile.points], "max_batch": profile.max_batch}))
        tmp.replace(path)


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4, ... and `cores` itself: the thread counts a CPU component is profiled at, at most."""
    counts = [1]
    while counts[-1] * 2 < cores:
        counts.append(counts[-1] * 2)
    return counts + [cores] if cores > 1 else counts


def _recorded_calls(pipeline: Pipeline) -> dict[tuple[str, str], list[Call]]:
    calls: dict[tuple[str, str], list[Call]] = {}
    for record in pipeline.recorded:
        name = pipeline.graph.name_of(record.component)
        if name is None:
            continue
        kept = calls.setdefault((name, record.method), [])
        if len(kept) < INPUTS_PER_METHOD:
            kept.append((record.args, record.kwargs))
    return calls


def _max_concurrency(component: Component, method: str) -> int | None:
    """The method's `@make(max_concurrency=...)`: None for a method the front-end batches."""
    return make_methods(type(component))[method].max_concurrency


async def _timed(replica: Replica, method: str, calls: list[Call], size: int, *, concurrent: bool) -> tuple[float, list[Outcome]]:
    """ms until every call of `calls` is answered, and their outcomes in order: sent as batches of `size`,
    one after another, or, `concurrent`, as one-call batches `size` at a time in flight (how the
    front-end sends a `max_concurrency` method: the next leaves as one is answered)."""
    started = time.perf_counter()
    if concurrent:
        slots = asyncio.Semaphore(size)

        async def one(call: Call) -> list[Outcome]:
            async with slots:
                return await replica.channel.run_batch(method, [call])

        replies = await asyncio.gather(*(one(call) for call in calls))
    else:
        replies = [await replica.channel.run_batch(method, calls[i : i + size]) for i in range(0, len(calls), size)]
    return (time.perf_counter() - started) * 1000, [outcome for reply in replies for outcome in reply]


def _out_of_memory(failure: Failure) -> bool:
    return failure.type_name in ("MemoryError", "OutOfMemoryError") or "out of memory" in failure.message.lower()


def _run_async(coroutine: Any) -> Any:
    """Run on a fresh event loop, in a thread when this one already runs a loop (Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="patchkit-profile") as pool:
        return pool.submit(asyncio.run, coroutine).result()


class _Progress:
    """One status line on stderr (rewritten in place on a terminal) while profiling runs."""

    def __init__(self, total: int, *, enabled: bool) -> None:
        self.total, self.finished, self.enabled = total, 0, enabled and total > 0
        self.tty = sys.stderr.isatty()

    def __enter__(self) -> _Progress:
        return self

    def note(self, what: str) -> None:
        if self.enabled and self.tty:
            print(f"\rprofiling [{self.finished}/{self.total}] {what:<60}", end="", file=sys.stderr, flush=True)

    def done(self, what: str) -> None:
        self.finished += 1
        if self.enabled:
            end = "" if self.tty and self.finished < self.total else "\n"
            prefix = "\r" if self.tty else ""
            print(f"{prefix}profiling [{self.finished}/{self.total}] {what:<60}", end=end, file=sys.stderr, flush=True)

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self.tty and self.finished < self.total:
            print(file=sys.stderr)
