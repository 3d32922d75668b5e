"""`Plan`: per component its resource type, replicas and batch size, with the throughput predicted.

Made by `plan()` from profiles and the MILP, or by hand; shown to the user as a table (the shape of
Patchwork's Table 3) and applied by `deploy(plan=...)`, which serves it at `GET /v1/plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from patchkit.errors import InputError
from patchkit.tables import text_table

__all__ = ["ComponentPlan", "Plan"]


@dataclass(frozen=True)
class ComponentPlan:
    resource: str  # "cpu" | "gpu"
    replicas: int
    batch_size: int
    throughput: float = 0.0  # calls/s its replicas sustain together, predicted
    units: int = 1  # resource units per replica
    visits: float = 1.0  # calls per request, measured on the calibration inputs
    default_batch_size: int | None = None  # what the component's own @make declares

    def __post_init__(self) -> None:
        if self.replicas < 1 or self.batch_size < 1 or self.units < 1:
            raise InputError(
                "a component plan needs replicas, batch_size and units >= 1; "
                f"got {self.replicas}, {self.batch_size}, {self.units}"
            )


@dataclass(frozen=True)
class Plan:
    components: Mapping[str, ComponentPlan]
    throughput: float  # requests/s the pipeline sustains, predicted
    bottleneck: str
    solver: str = "manual"
    capacity: Mapping[str, int] = field(default_factory=dict)  # the pool planned for
    virtual: tuple[str, ...] = ()  # resource types the machine lacks: their replicas run on virtual devices
    slo_ms: float | None = None

    def used(self) -> dict[str, int]:
        """Resource units the plan takes, per type."""
        used: dict[str, int] = {}
        for c in self.components.values():
            used[c.resource] = used.get(c.resource, 0) + c.replicas * c.units
        return used

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: `{"components": {NAME: {"resource", "replicas", "batch_size", "throughput", ...}},
        "throughput", "bottleneck", ...}`."""
        return {
            "components": {name: asdict(c) for name, c in self.components.items()},
            "throughput": self.throughput,
            "bottleneck": self.bottleneck,
            "solver": self.solver,
            "capacity": dict(self.capacity),
            "used": self.used(),
            "virtual": list(self.virtual),
            "slo_ms": self.slo_ms,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """A plan saved with `to_dict()` (as `patchkit plan --json` prints it)."""
        try:
            components = {name: ComponentPlan(**c) for name, c in data["components"].items()}
            return cls(
                components, float(data["throughput"]), str(data["bottleneck"]), str(data.get("solver", "manual")),
                dict(data.get("capacity", {})), tuple(data.get("virtual", ())), data.get("slo_ms"),
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"not a plan: {type(exc).__name__}: {exc}; pass what Plan.to_dict() returns") from None

    def table(self) -> str:
        """The plan as a text table, one row per component (the bottleneck starred), then the totals."""
        rows = []
        for name, c in self.components.items():
            rows.append((
                name + (" *" if name == self.bottleneck else ""),
                c.resource + (" (virtual)" if c.resource in self.virtual else ""),
                str(c.replicas),
                "-" if c.default_batch_size is None else str(c.default_batch_size),
                str(c.batch_size),
                f"{c.visits:.2f}",
                f"{c.throughput:.1f}",
            ))
        header = ("component", "resource", "replicas", "default batch", "batch", "visits", "calls/s")
        used = ", ".join(f"{kind} {n}/{self.capacity.get(kind, n)}" for kind, n in sorted(self.used().items()))
        lines = [
            text_table(header, rows, left=2),
            f"predicted {self.throughput:.1f} requests/s; bottleneck {self.bottleneck}; uses {used}; solver {self.solver}",
        ]
        if self.virtual:
            lines.append(f"virtual devices (this machine has too few): {', '.join(self.virtual)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.table())}</pre>"
