"""`plan()`: calibration runs, then the profiler, then the MILP, then a `Plan`.

Users reach it through `patchkit.plan` (`patchkit.client.planning`), which finds the last capture.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from patchkit.component import make_methods
from patchkit.errors import InputError, PlanError
from patchkit.scheduler.offline.milp import Option, Problem, solve
from patchkit.scheduler.offline.plan import ComponentPlan, Plan
from patchkit.scheduler.offline.pool import ResourcePool

if TYPE_CHECKING:
    from patchkit.client.pipeline import Pipeline

__all__ = ["plan"]

logger = logging.getLogger(__name__)


def plan(
    pipeline: Pipeline,
    *,
    resources: Mapping[str, int] | None = None,
    calibration: Sequence[Mapping[str, Any]] | None = None,
    slo_ms: float | None = None,
    progress: bool = True,
) -> Plan:
    """Profile `pipeline`'s components and choose, per component, a resource type, replicas and a
    batch size that maximise the pipeline's throughput on `resources` (default: this machine).

    `calibration`: inputs to run the pipeline on first, eagerly and locally, as `pipeline(**inputs)`;
    their calls become the profiler's inputs and give each component's visits per request. Without
    them, the capture's own eager run is used. `slo_ms`: plans only batch sizes whose latency fits it.
    """
    from patchkit.scheduler.offline.profiler import Profiler, visits_by_component  # starts workers: gRPC loads only here

    pool = ResourcePool.resolve(resources)
    _calibrate(pipeline, calibration)
    visits = {name: sum(methods.values()) for name, methods in visits_by_component(pipeline).items()}
    idle = {name: pipeline.components[name] for name, v in visits.items() if not v}
    capacity = dict(pool.capacity)
    fixed = {name: _idle_plan(name, component, capacity) for name, component in idle.items()}
    profiles = Profiler(pool, progress=progress).run(pipeline)
    options = tuple(Option(p.component, p.resource, 1, p.latency(), p.max_batch) for p in profiles)
    solution = solve(Problem(options, {n: v for n, v in visits.items() if v}, capacity, slo_ms))
    logger.info("planned with %s: %.1f requests/s, bottleneck %s", solution.solver, solution.throughput, solution.bottleneck)
    planned = {
        name: ComponentPlan(
            c.resource, c.replicas, c.batch_size, c.throughput, visits=visits[name],
            default_batch_size=_default_batch(pipeline.components[name]),
        )
        for name, c in solution.choices.items()
    }
    components = {name: planned.get(name) or fixed[name] for name in pipeline.components}
    virtual = tuple(sorted(pool.virtual))
    return Plan(components, solution.throughput, solution.bottleneck, solution.solver, dict(pool.capacity), virtual, slo_ms)


def _calibrate(pipeline: Pipeline, calibration: Sequence[Mapping[str, Any]] | None) -> None:
    if calibration is not None:
        if isinstance(calibration, Mapping) or not all(isinstance(inputs, Mapping) for inputs in calibration):
            raise InputError("calibration takes a list of input dicts, such as [{'query': 'What is a generator?'}, ...]")
        for inputs in calibration:
            pipeline(**inputs)
    if pipeline.graph.runs == 0:
        raise PlanError(
            "the pipeline has never run, so there is nothing to profile it with: capture it with capture(run=True) "
            "or pass calibration=[{...}, ...] inputs"
        )


def _idle_plan(name: str, component: Any, capacity: dict[str, int]) -> ComponentPlan:
    """One replica for a component the calibration runs never called; its unit is set aside."""
    for kind in component.devices:
        if capacity.get(kind, 0) > 0:
            capacity[kind] -= 1
            size = _default_batch(component)
            return ComponentPlan(kind, 1, size or 1, visits=0.0, default_batch_size=size)
    kinds = " or ".join(component.devices)
    raise PlanError(f"{name} needs one {kinds} unit and none is left; declare more with resources={{...}}")


def _default_batch(component: Any) -> int | None:
    sizes = [component.batch_limit(method) for method in make_methods(type(component))]
    return max(sizes) if sizes else None
