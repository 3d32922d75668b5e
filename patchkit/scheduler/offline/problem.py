"""What the planner's MILP (`milp.py`) is asked and what it answers.

`Problem`: every component's `Option`s (a resource type, the units a replica takes of it and the
batch latency profiled there), its visits per request and the resources there are; built by
`planner.py` from the profiles. `Solution`: a `Choice` per component (resource, replicas, batch
size) with the pipeline's predicted throughput, made by `milp.solve`. `Option` and `Problem` check
their fields when made, naming the component and the value at fault.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from patchkit.scheduler.offline.pwl import PiecewiseLinear

__all__ = ["Choice", "Option", "Problem", "Solution"]


@dataclass(frozen=True)
class Option:
    """One way to run a component: on one resource type, with `units` of it a replica, and its latency curve so."""

    component: str
    resource: str  # "cpu" | "gpu" (any key of Problem.capacity)
    units: int  # resource units one replica takes (r[o])
    latency: PiecewiseLinear  # ms per batch as a function of batch size, on that resource with those units
    max_batch: int  # memory-bounded largest batch
    threads: int = 1  # threads one replica runs with (what the profile was measured at)
    most_replicas: int | None = None  # at most this many replicas (m[o]); None: as many as the units allow
    holds: int = 0  # declared units (cores) one replica holds, lent part included (h[o]); 0: it shares them

    @property
    def key(self) -> tuple[str, str, int]:
        """(component, resource, units): what tells a component's options apart."""
        return self.component, self.resource, self.units

    def __post_init__(self) -> None:
        if self.most_replicas is not None and self.most_replicas < 1:
            raise ValueError(f"{self.component} on {self.resource}: most_replicas must be >= 1; got {self.most_replicas!r}")
        for name, least in (("units", 1), ("max_batch", 1), ("threads", 1), ("holds", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{self.component} on {self.resource}: {name} must be an int >= {least}; got {value!r}")


@dataclass(frozen=True)
class Problem:
    """What the planner knows: the options of every component, their visits, and the resources."""

    options: tuple[Option, ...]
    visits: Mapping[str, float]  # calls per request of each component (branches, loops), > 0
    capacity: Mapping[str, int]  # units available per resource type, e.g. {"cpu": 5, "gpu": 2}
    slo_ms: float | None = None
    # units per unit a user declares, where they differ (the planner's {"cpu": SHARES_PER_CORE}): errors say what to declare
    per_declared: Mapping[str, int] = field(default_factory=dict)

    def declared(self, kind: str, units: int) -> int:
        """The declared units (cores, GPUs) that hold `units` of `kind`."""
        return -(-units // self.per_declared.get(kind, 1))

    def __post_init__(self) -> None:
        for name, visits in self.visits.items():
            if not (math.isfinite(visits) and visits > 0):
                raise ValueError(f"visits of {name} must be a finite number > 0; got {visits!r}")
        for kind, units in self.capacity.items():
            if isinstance(units, bool) or not isinstance(units, int) or units < 0:
                raise ValueError(f"capacity of {kind} must be an int >= 0; got {units!r}")
        if self.slo_ms is not None and not (math.isfinite(self.slo_ms) and self.slo_ms > 0):
            raise ValueError(f"slo_ms must be a finite number > 0; got {self.slo_ms!r}")
        seen = set()
        for option in self.options:
            if option.component not in self.visits:
                raise ValueError(f"an option runs {option.component}, which has no visits entry")
            if option.key in seen:
                raise ValueError(
                    f"{option.component} has two options on {option.resource} of {option.units} units a replica; "
                    "options on one resource type must differ in units"
                )
            seen.add(option.key)


@dataclass(frozen=True)
class Choice:
    """The plan of one component."""

    component: str
    resource: str
    replicas: int
    batch_size: int
    throughput: float  # calls/s of all its replicas
    units: int = 1  # units of `resource` one replica takes
    batch_ms: float = 0.0  # T(batch_size): milliseconds one batch takes
    threads: int = 1  # threads one replica runs with


@dataclass(frozen=True)
class Solution:
    """The plan of every component, the pipeline's predicted throughput and what limits it."""

    choices: Mapping[str, Choice]
    throughput: float  # requests/s of the pipeline
    bottleneck: str  # the component whose throughput / visits is smallest
    solver: str  # "gurobi" | "highs"
    used: Mapping[str, int] = field(default_factory=dict)  # units taken per resource type
    latency_ms: float = 0.0  # per-request latency estimate: sum of visits * 2 * T(batch)
