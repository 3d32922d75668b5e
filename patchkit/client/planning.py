"""`patchkit.plan()`: the offline planner, on the pipelines given or the last one captured."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from patchkit.client.pipeline import Pipeline, last_pipeline
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
    """Profile the components of `pipelines` (default: the last capture) and choose, per component, a
    resource type, replicas and a batch size that maximise the requests/s served on `resources`
    (default: this machine).

    `pipelines` is one pipeline, or several that one deployment serves, by name
    (`{"crag": crag, "hyde": hyde}`), planned as a whole: a component they share is planned once, and
    `weights` (default equal) is each one's share of the requests. See
    `patchkit.scheduler.offline.planner.plan` for the arguments.
    """
    chosen = pipelines if pipelines is not None else last_pipeline()
    return plan_pipelines(
        chosen, weights=weights, resources=resources, calibration=calibration, slo_ms=slo_ms, progress=progress
    )
