"""What the profiler gives the planner: per component, resource type and thread count, its methods' T(b)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from patchkit.scheduler.offline.pwl import PiecewiseLinear

__all__ = ["ComponentProfile", "MethodProfile"]


@dataclass(frozen=True)
class MethodProfile:
    """One method's ms per batch of b calls (or per b calls at once), measured or predicted.

    `model`: for an engine profiled through its cost model (`costmodel`), the fitted costs, the
    calls it was built from, and its relative errors against measured whole calls (`error`, the
    largest), or, at a thread count that did not pay, why it `stopped`; None for a method whose
    sizes were all measured."""

    method: str
    points: tuple[tuple[int, float], ...]  # (batch size or calls at once, median ms per batch of that many), ascending
    max_batch: int  # the largest batch (or concurrency level) that ran (memory-bounded)
    model: Mapping[str, Any] | None = None

    @property
    def model_error(self) -> float | None:
        """The cost model's largest relative error against measured whole calls; None without a model."""
        return float(self.model["error"]) if self.model is not None and "error" in self.model else None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"points": [list(p) for p in self.points], "max_batch": self.max_batch}
        if self.model is not None:
            data["model"] = dict(self.model)
        return data

    @classmethod
    def from_dict(cls, method: str, data: Mapping[str, Any]) -> MethodProfile:
        """The inverse of `to_dict()`; a KeyError, TypeError or ValueError for anything else."""
        points = tuple((int(b), float(ms)) for b, ms in data["points"])
        model = data.get("model")
        return cls(method, points, int(data["max_batch"]), dict(model) if model is not None else None)


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

    @property
    def model_error(self) -> float | None:
        """The largest error of its methods' cost models against measured whole calls; None when none has one."""
        errors = [m.model_error for m in self.methods.values() if m.model_error is not None]
        return max(errors) if errors else None

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
        return {name: m.to_dict() for name, m in self.methods.items()}
