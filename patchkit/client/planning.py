"""`patchkit.plan()`: the offline planner, on the pipeline given or the last one captured."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from patchkit.client.pipeline import Pipeline, last_pipeline
from patchkit.scheduler.offline.plan import Plan
from patchkit.scheduler.offline.planner import plan as plan_pipeline

__all__ = ["plan"]


def plan(
    pipeline: Pipeline | None = None,
    *,
    resources: Mapping[str, int] | None = None,
    calibration: Sequence[Mapping[str, Any]] | None = None,
    slo_ms: float | None = None,
    progress: bool = True,
) -> Plan:
    """Profile `pipeline`'s components (default: the last capture) and choose, per component, a
    resource type, replicas and a batch size that maximise the pipeline's throughput on `resources`
    (default: this machine). See `patchkit.scheduler.offline.planner.plan` for the arguments.
    """
    pipeline = pipeline if pipeline is not None else last_pipeline()
    return plan_pipeline(pipeline, resources=resources, calibration=calibration, slo_ms=slo_ms, progress=progress)
