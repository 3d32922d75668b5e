"""The resources a plan divides: detected on this machine, or declared (`resources={"cpu": 8, "gpu": 4}`).

A declared pool may hold more than the machine has: the planner then plans for it and the
deployment runs each replica of the missing kind on a virtual device (a GPU replica that sees no
GPU, CPU replicas that share cores), which is how simulated GPU pipelines are planned and served
on a laptop. `virtual` names those kinds, and the plan says so.

The pool is declared in cores and GPUs; the MILP counts CPU in shares of a core (`units()`,
`SHARES_PER_CORE` a core), so that light replicas can share one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from patchkit.errors import InputError
from patchkit.orchestrator.resources import SHARES_PER_CORE, available_cpus, available_gpus

__all__ = ["RESOURCE_TYPES", "ResourcePool"]

RESOURCE_TYPES = ("cpu", "gpu")


@dataclass(frozen=True)
class ResourcePool:
    capacity: Mapping[str, int]  # units per resource type
    virtual: frozenset[str] = frozenset()  # types with more units declared than the machine has

    @classmethod
    def resolve(cls, resources: Mapping[str, int] | None = None) -> ResourcePool:
        """This machine's cores and GPUs, or the declared pool, checked; called by `plan()` and `deploy()`."""
        machine = {"cpu": len(available_cpus()), "gpu": len(available_gpus())}
        if resources is None:
            return cls(machine)
        if not isinstance(resources, Mapping):
            raise InputError(f"resources must be a mapping such as {{'cpu': 8, 'gpu': 2}}; got {resources!r}")
        for kind, units in resources.items():
            if kind not in RESOURCE_TYPES:
                raise InputError(f"resources names {kind!r}; the resource types are {', '.join(RESOURCE_TYPES)}")
            if isinstance(units, bool) or not isinstance(units, int) or units < 0:
                raise InputError(f"resources[{kind!r}] must be a whole number of units >= 0; got {units!r}")
        capacity = {kind: int(resources.get(kind, machine[kind])) for kind in RESOURCE_TYPES}
        return cls(capacity, frozenset(kind for kind in RESOURCE_TYPES if capacity[kind] > machine[kind]))

    @classmethod
    def parse(cls, text: str) -> ResourcePool:
        """`cpu=5,gpu=2`, as the command line takes it."""
        declared: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            kind, _, units = part.partition("=")
            if not units.strip().isdigit():
                raise InputError(f"--resources takes kind=units pairs such as cpu=5,gpu=2; got {part!r}")
            declared[kind.strip()] = int(units)
        return cls.resolve(declared)

    def units(self) -> dict[str, int]:
        """The units the MILP divides: shares of a core on "cpu" (SHARES_PER_CORE a core), GPUs on "gpu"."""
        return {kind: n * SHARES_PER_CORE if kind == "cpu" else n for kind, n in self.capacity.items()}

    def describe(self) -> dict[str, object]:
        return {"capacity": dict(self.capacity), "virtual": sorted(self.virtual)}
