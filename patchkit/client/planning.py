"""`patchkit.plan()`: the offline planner, on the pipelines given or the last one captured."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from patchkit.program.pipeline import Pipeline, last_pipeline
from patchkit.scheduler.offline.plan import Plan
from patchkit.scheduler.offline.planner import plan as plan_pipelines

__all__ = ["plan"]


def plan(
    pipelines: Pipeline | Mapping[str, Pipeline] | None = None,
    *,
    weights: Mapping[str, float] | None = None,
    resources: Mapping[str, int] | None = None,
    calibration: Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    slo_ms: float | None = None,
    progress: bool = True,
) -> Plan:
    """Profile the components of `pipelines` and choose, per component, a resource, replicas and a batch size.

    The plan maximises the requests/s served on `resources` (default: this machine); `deploy(pipeline,
    plan=plan)` applies it, `deploy(plan="auto")` makes one first, and `plan.table()` shows it. Several
    pipelines that one deployment serves (`{"crag": crag, "hyde": hyde}`) are planned as a whole.

    Args:
        pipelines: one pipeline (default: the last capture), or several that one deployment serves, by
            name. The plan's components are named as the deployment names them: a component object
            several pipelines call is one component, planned once, its visits per request the pipelines'
            visits weighted by `weights`; the throughput is then requests/s of that mix.
        weights: with several pipelines, each one's share of the requests (numbers >= 0, at least one
            > 0, one per pipeline; normalised to sum 1). Default: equal shares.
        resources: the pool to plan for, such as `{"cpu": 5, "gpu": 2}` (default: this machine's).
        calibration: inputs to run a pipeline on first, eagerly and locally, as `pipeline(**inputs)`;
            with several pipelines, a mapping name -> inputs (a pipeline it does not name keeps what it
            recorded). Their calls (and theirs only) become the profiler's inputs, and they count in each
            component's visits per request. Without them, every call the pipeline recorded is used.
            Profiles are cached: planning the same pipelines with the same calibration again profiles
            nothing, whatever the weights.
        slo_ms: plans only batch sizes whose latency fits it.
        progress: show a progress line per component while profiling.

    Returns:
        The `Plan`, which records the weights it was made for (none for one pipeline given alone).

    Raises:
        ConfigError: `pipelines` or `weights` is not as above (the message says what to fix).
        InputError: `calibration` is not a list of input dicts (by pipeline name, with several).
        PlanError: a pipeline never ran and has no calibration, or no plan fits the resources or the SLO.
    """
    chosen = pipelines if pipelines is not None else last_pipeline()
    return plan_pipelines(
        chosen, weights=weights, resources=resources, calibration=calibration, slo_ms=slo_ms, progress=progress
    )
