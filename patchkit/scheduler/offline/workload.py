"""`Workload`: what a plan is made for: the pipelines of one deployment, each one's share of the requests,
and their components, one entry per component object.

Made by `plan()` from what the user passes: one pipeline, or a mapping name -> pipeline with `weights=`
(default equal shares); read by the planner and the profiler. One pipeline given alone is a workload of
one entry: the planner has one path. Components are named as the deployment names them
(`deployed_names`): a component object several pipelines call is one component, and its visits per
request of the mix are the weighted sum of its visits in each pipeline, so that the plan's throughput is
requests/s of the mix. It is profiled once, with the calls of every pipeline that calls it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from patchkit.errors import ConfigError
from patchkit.program.identity import deployed_names

if TYPE_CHECKING:
    from patchkit.capture.recorder import CallRecord
    from patchkit.core import Component
    from patchkit.program.pipeline import Pipeline  # the top layer: a type only

__all__ = ["Workload", "interleave", "visits_by_component"]

ALONE = "pipeline"  # the name of a pipeline given alone (messages say "the pipeline")
T = TypeVar("T")


def visits_by_component(pipeline: Pipeline) -> dict[str, dict[str, float]]:
    """Calls per request of each of the pipeline's components' methods, averaged over its eager runs
    (branches, loops), by the pipeline's own names."""
    visits: dict[str, dict[str, float]] = {name: {} for name in pipeline.components}
    per_node = pipeline.graph.visits_per_run()
    for node in pipeline.graph.nodes.values():
        methods = visits.setdefault(node.component, {})
        methods[node.method] = methods.get(node.method, 0.0) + per_node[node.id]
    return visits


@dataclass(frozen=True)
class Workload:
    """The pipelines a plan is for and each one's share of the requests. Made with `Workload.of`."""

    pipelines: Mapping[str, Pipeline]
    weights: Mapping[str, float]  # each pipeline's share of the requests: >= 0, summing to 1
    alone: bool = False  # one pipeline given alone, not by name: its plan records no weights

    @classmethod
    def of(cls, pipelines: Pipeline | Mapping[str, Pipeline], weights: Mapping[str, float] | None = None) -> Workload:
        """Check what `plan()` was given and normalise the weights. Called by `plan()` and the profiler.

        Raises:
            ConfigError: `pipelines` is an empty mapping or maps a name to something else than a pipeline;
                `weights` is given with one pipeline alone, or does not name exactly the pipelines, or a weight
                is not a finite number >= 0, or none is > 0.
        """
        if not isinstance(pipelines, Mapping):
            if weights is not None:
                raise ConfigError(
                    "weights= shares the requests among several pipelines: pass them by name, "
                    "plan({'crag': crag, 'hyde': hyde}, weights={'crag': 3, 'hyde': 1})"
                )
            return cls({ALONE: _checked_pipeline(ALONE, pipelines)}, {ALONE: 1.0}, alone=True)
        if not pipelines:
            raise ConfigError("plan() was given no pipeline: pass one, or a mapping such as {'crag': crag, 'hyde': hyde}")
        named = {_checked_name(name): _checked_pipeline(name, p) for name, p in pipelines.items()}
        return cls(named, _normalised(weights, list(named)))

    @property
    def components(self) -> dict[str, Component]:
        """Every pipeline's components, one entry per component object, by its deployed name."""
        return deployed_names({name: p.components for name, p in self.pipelines.items()})

    def names_by_uid(self) -> dict[str, str]:
        """The deployed name of each of the pipelines' components, by the component's uid."""
        return {c._patchkit_spec.uid: name for name, c in self.components.items()}

    def visits(self) -> dict[str, dict[str, float]]:
        """Calls per request of the mix of each component's methods, by deployed name: per pipeline its
        visits on its eager runs so far (`visits_by_component`), times the pipeline's weight, summed."""
        deployed = self.names_by_uid()
        visits: dict[str, dict[str, float]] = {name: {} for name in deployed.values()}
        for pipeline_name, pipeline in self.pipelines.items():
            weight, local = self.weights[pipeline_name], pipeline.components
            for name, methods in visits_by_component(pipeline).items():
                deployed_name = deployed[local[name]._patchkit_spec.uid] if name in local else name
                methods_of = visits.setdefault(deployed_name, {})
                for method, v in methods.items():
                    methods_of[method] = methods_of.get(method, 0.0) + weight * v
        return visits

    def recorded(self) -> list[CallRecord]:
        """Every call the pipelines recorded, interleaved (`interleave`)."""
        return interleave(list(p.recorded) for p in self.pipelines.values())

    def label(self, name: str) -> str:
        """How messages name one of the pipelines."""
        return "the pipeline" if self.alone else f"pipeline {name!r}"


def interleave(lists: Iterable[list[T]]) -> list[T]:
    """The pipelines' recorded calls taken in turn, one of each, each pipeline's in its order: the profiler
    keeps a component's first distinct calls, which then hold every pipeline's that calls it.

    Not in proportion to the weights: the calls a component is profiled with, and so its cached profile,
    stay the same when only the weights change."""
    taken = list(lists)
    return [each[i] for i in range(max(map(len, taken), default=0)) for each in taken if i < len(each)]


def _checked_name(name: Any) -> str:
    if not isinstance(name, str) or not name or "/" in name:
        raise ConfigError(f"a pipeline's name must be a non-empty string without '/'; got {name!r}")
    return name


def _checked_pipeline(name: str, pipeline: Any) -> Pipeline:
    if isinstance(pipeline, Mapping) or not hasattr(pipeline, "graph") or not hasattr(pipeline, "recorded"):
        raise ConfigError(f"plan() takes captured pipelines (patchkit.capture); {name} is a {type(pipeline).__name__}")
    return pipeline


def _normalised(weights: Mapping[str, float] | None, names: list[str]) -> dict[str, float]:
    """Each pipeline's share of the requests, summing to 1; equal without `weights`."""
    if weights is None:
        return dict.fromkeys(names, 1.0 / len(names))
    example = "weights={" + ", ".join(f"{n!r}: 1" for n in names) + "}"
    if not isinstance(weights, Mapping):
        raise ConfigError(f"weights must map each pipeline's name to its share of the requests, {example}; got {weights!r:.80}")
    unknown, missing = [n for n in weights if n not in names], [n for n in names if n not in weights]
    wrong = ([f"name {', '.join(map(repr, unknown))}, not a pipeline"] if unknown else []) + (
        [f"have no weight for {', '.join(map(repr, missing))}"] if missing else [])
    if wrong:
        raise ConfigError(f"weights {' and '.join(wrong)}: give one per pipeline ({', '.join(map(repr, names))}), {example}")
    for name, weight in weights.items():
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight < 0:
            raise ConfigError(f"the weight of {name!r} must be a finite number >= 0 (its share of the requests); got {weight!r}")
    total = math.fsum(weights.values())
    if total <= 0:
        raise ConfigError(f"weights are all 0: at least one pipeline must have a share of the requests, {example}")
    return {name: weights[name] / total for name in names}
