"""`plan()`: calibration runs, then the profiler, then the MILP, then a `Plan`.

Users reach it through `patchkit.plan` (`patchkit.client.planning`), which finds the last capture.
It plans one pipeline, or the several pipelines of one deployment as a whole (`workload`): a component
they share is one component, its visits the pipelines' weighted by their shares of the requests.

CPU is divided in shares of a core (`SHARES_PER_CORE` a core), so that five components fit two
cores and an engine that scales with threads can get several. Each CPU profile at t threads (t
cores, one thread each) becomes an option of t * SHARES_PER_CORE units, and options of l fewer (l in
`LENT_SIZES`), lending l shares of its last core to share replicas, with T(b) scaled by the shares
it gives up: on 2 cores the LLM's engine then computes on both, or two 1-thread engines on a core
each, while the light components take what they lend, where whole cores alone would leave the
engine one. The 1-thread profile also becomes share options, 1 thread on a core shared with other
light replicas, taking s of its shares (s in `SHARE_SIZES`) with T(b) scaled by SHARES_PER_CORE / s:
a replica with an eighth of a busy core runs about eight times slower. That is pessimistic for a
replica whose core-mates are idle (a grader waiting on the LLM), which is the safe side. A share
option has one replica: shares are for components that need less than a core; one that needs more
takes whole cores, rather than replicas contending for the same cores. A GPU profile is an option
of one GPU.
The MILP then picks, per component, one option (resource, threads or share), a batch and replicas.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from patchkit.capture.holders import given_components
from patchkit.core import Component, is_set_up, make_methods, release_setup
from patchkit.errors import InputError, PlanError
from patchkit.orchestrator.resources import SHARE_SIZES, SHARES_PER_CORE, lending_units
from patchkit.program.pipeline import stamp
from patchkit.scheduler.offline.calibration import CalibrationCache
from patchkit.scheduler.offline.milp import solve
from patchkit.scheduler.offline.plan import ComponentPlan, Plan
from patchkit.scheduler.offline.pool import ResourcePool
from patchkit.scheduler.offline.problem import Option, Problem
from patchkit.scheduler.offline.workload import Workload, interleave

if TYPE_CHECKING:
    from patchkit.capture.recorder import CallRecord
    from patchkit.program.pipeline import Pipeline
    from patchkit.scheduler.offline.profiles import ComponentProfile

__all__ = ["options_of", "plan"]

logger = logging.getLogger(__name__)


def plan(
    pipelines: Pipeline | Mapping[str, Pipeline],
    *,
    weights: Mapping[str, float] | None = None,
    resources: Mapping[str, int] | None = None,
    calibration: Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    slo_ms: float | None = None,
    progress: bool = True,
) -> Plan:
    """Profile the pipelines' components and choose, per component, a resource type, replicas and a
    batch size that maximise the requests/s served on `resources` (default: this machine).

    Called by `patchkit.plan`, `deploy(plan="auto")` and `patchkit plan` / `patchkit serve --plan auto`;
    `patchkit.plan`'s docstring says each argument, what it returns and raises. The components it sets
    up here to run the calibration (none set up before) are released when it returns (`Component.teardown`).
    """
    workload = Workload.of(pipelines, weights)
    stamp(pipelines)  # the versions its caches are keyed by: an edit of what a component does profiles it again
    pool = ResourcePool.resolve(resources)
    unloaded = [c for c in _reachable(workload.components.values()) if not is_set_up(c)]
    try:
        return _plan(workload, pool, calibration, slo_ms, progress)
    finally:
        released = [type(c).__name__ for c in unloaded if release_setup(c)]
        if released:
            logger.info("released what calibration loaded here: %s (their next call here sets them up again)",
                        ", ".join(released))


def _plan(workload: Workload, pool: ResourcePool, calibration: Any, slo_ms: float | None, progress: bool) -> Plan:
    """`plan`'s work, the components it sets up here left loaded."""
    from patchkit.scheduler.offline.profiler import Profiler  # starts workers: gRPC loads only here

    records = _calibrate(workload, calibration)
    components = workload.components
    visits = {name: sum(methods.values()) for name, methods in workload.visits().items()}
    idle = {name: components[name] for name, v in visits.items() if not v}
    capacity = pool.units()
    fixed = {name: _idle_plan(name, component, capacity) for name, component in idle.items()}
    profiles = Profiler(pool, progress=progress).run(workload, records)
    errors = _model_errors(profiles)
    options = tuple(option for p in profiles for option in options_of(p))
    called = {n: v for n, v in visits.items() if v}
    solution = solve(Problem(options, called, capacity, slo_ms, per_declared={"cpu": SHARES_PER_CORE}))
    logger.info("planned with %s: %.1f requests/s, bottleneck %s", solution.solver, solution.throughput, solution.bottleneck)
    planned = {
        name: ComponentPlan(
            c.resource, c.replicas, c.batch_size, c.throughput, c.units, visits[name],
            _default_batch(components[name]), c.threads, errors.get(name),
        )
        for name, c in solution.choices.items()
    }
    chosen = {name: planned.get(name) or fixed[name] for name in components}
    virtual = tuple(sorted(pool.virtual))
    shares = {} if workload.alone else dict(workload.weights)
    return Plan(
        chosen, solution.throughput, solution.bottleneck, solution.solver, dict(pool.capacity), virtual, slo_ms, shares,
    )


def _reachable(components: Iterable[Component]) -> list[Component]:
    """`components` and every component their constructors were given, however deep."""
    found: dict[int, Component] = {}
    waiting = list(components)
    while waiting:
        component = waiting.pop()
        if id(component) in found:
            continue
        found[id(component)] = component
        waiting += given_components(component)
    return list(found.values())


def options_of(profile: ComponentProfile) -> list[Option]:
    """The MILP's options for one profile: its own units; on CPU also lending part of its last core, and at
    1 thread the shares of a core."""
    latency, top = profile.latency(), profile.max_batch
    if profile.resource != "cpu":
        return [Option(profile.component, profile.resource, 1, latency, top)]
    units = profile.threads * SHARES_PER_CORE
    whole = Option(profile.component, "cpu", units, latency, top, profile.threads, holds=profile.threads)
    lending = [dataclasses.replace(whole, units=u, latency=latency.scaled(units / u)) for u in lending_units(profile.threads)]
    if profile.threads > 1:
        return [whole, *lending]
    shares = [Option(profile.component, "cpu", s, latency.scaled(SHARES_PER_CORE / s), top, most_replicas=1) for s in SHARE_SIZES]
    return [whole, *lending, *shares]


def _model_errors(profiles: Sequence[ComponentProfile]) -> dict[str, float]:
    """Per component profiled through a cost model, its largest error against measured whole calls, logged."""
    errors: dict[str, float] = {}
    for profile in profiles:
        if profile.model_error is not None:
            errors[profile.component] = max(errors.get(profile.component, 0.0), profile.model_error)
    for name, error in errors.items():
        logger.info("%s: planned from its cost model, within %.1f%% of measured whole calls", name, 100 * error)
    return errors


def _calibrate(
    workload: Workload, calibration: Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Mapping[str, Any]]] | None
) -> list[CallRecord]:
    """Each pipeline's calls to profile with (`_calibrate_one`), taken in turn (`interleave`)."""
    if workload.alone:
        given = {name: calibration for name in workload.pipelines}
    elif calibration is None:
        given = {}
    elif not isinstance(calibration, Mapping):
        example = ", ".join(f"{name!r}: [{{...}}, ...]" for name in workload.pipelines)
        raise InputError(f"with several pipelines, calibration takes their inputs by name, such as {{{example}}}")
    else:
        unknown = [name for name in calibration if name not in workload.pipelines]
        if unknown:
            raise InputError(f"calibration names {', '.join(map(repr, unknown))}, not a pipeline; "
                             f"the pipelines are {', '.join(map(repr, workload.pipelines))}")
        given = dict(calibration)
    return interleave(_calibrate_one(workload, name, given.get(name)) for name in workload.pipelines)


def _calibrate_one(workload: Workload, name: str, calibration: Any) -> list[CallRecord]:
    """Run the calibration inputs (or read their runs back: `CalibrationCache`); the calls to profile with:
    theirs, or without any, all the pipeline recorded.

    Only theirs: a plan made again with the same calibration then profiles the same calls (and reads the
    profiler's cache), however often the pipeline ran before."""
    pipeline = workload.pipelines[name]
    already = len(pipeline.recorded)
    if calibration is not None:
        if isinstance(calibration, Mapping) or not all(isinstance(inputs, Mapping) for inputs in calibration):
            raise InputError("calibration takes a list of input dicts, such as [{'query': 'What is a generator?'}, ...]")
        runs = CalibrationCache()
        for inputs in calibration:
            runs.run(pipeline, inputs)
    if pipeline.graph.runs == 0:
        inputs = "[{...}, ...]" if workload.alone else f"{{{name!r}: [{{...}}, ...]}}"
        raise PlanError(
            f"{workload.label(name)} has never run, so there is nothing to profile it with: capture it with "
            f"capture(run=True) or pass calibration={inputs} inputs"
        )
    fresh = pipeline.recorded[already:]
    return fresh if calibration is not None and fresh else list(pipeline.recorded)  # none: the record was full


def _idle_plan(name: str, component: Any, capacity: dict[str, int]) -> ComponentPlan:
    """One replica for a component the calibration runs never called; its unit (on "cpu" a share of a core) is set aside."""
    for kind in component.devices:
        if capacity.get(kind, 0) > 0:
            capacity[kind] -= 1
            size = _default_batch(component)
            return ComponentPlan(kind, 1, size or 1, units=1, visits=0.0, default_batch_size=size)
    kinds = " or ".join(component.devices)
    raise PlanError(f"{name} needs one {kinds} unit and none is left; declare more with resources={{...}}")


def _default_batch(component: Any) -> int | None:
    sizes = [component.batch_limit(method) for method in make_methods(type(component))]
    return max(sizes) if sizes else None
