"""`Plan`: per component its resource type, replicas, threads (or share of a core) and batch size.

With the throughput predicted. Made by `plan()` from profiles and the MILP, or by hand; shown to the user as a
table and applied by `deploy(plan=...)`, which serves it at `GET /v1/plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from patchkit.errors import InputError
from patchkit.orchestrator.resources import SHARE_SIZES, SHARES_PER_CORE, lending_units, lent_shares, valid_cpu_units
from patchkit.tables import text_table

__all__ = ["ComponentPlan", "Plan"]


@dataclass(frozen=True)
class ComponentPlan:
    """One component's part of a plan.

    On "cpu" a replica either holds `threads` whole cores, one thread each (units = threads * SHARES_PER_CORE), or as many cores
    lending part of its last one to share replicas (one of LENT_SIZES fewer units), or runs 1 thread on a core it shares with
    other replicas, taking `units` of its SHARES_PER_CORE shares (one of SHARE_SIZES).

    Attributes:
        resource: "cpu" or "gpu".
        replicas: how many replicas to run.
        batch_size: the batch size of its methods (of a `max_concurrency` method, its calls at once per replica).
        throughput: calls/s its replicas sustain together, predicted.
        units: per replica, shares of a core on "cpu", GPUs on "gpu".
        visits: calls per request, measured on the calibration inputs.
        default_batch_size: what the component's own `@make` declares.
        threads: per replica, its math-library threads (OMP_NUM_THREADS).
        model_error: planned from a cost model: its largest relative error against measured calls.

    Raises:
        InputError: a count below 1, or CPU units a replica of that many threads cannot take.
    """

    resource: str  # "cpu" | "gpu"
    replicas: int
    batch_size: int
    throughput: float = 0.0  # calls/s its replicas sustain together, predicted
    units: int = 0  # per replica: shares of a core on "cpu", GPUs on "gpu"; 0: whole cores for `threads`, or one GPU
    visits: float = 1.0  # calls per request, measured on the calibration inputs
    default_batch_size: int | None = None  # what the component's own @make declares
    threads: int = 1  # per replica: its math-library threads (OMP_NUM_THREADS)
    model_error: float | None = None  # planned from a cost model: its largest relative error against measured calls

    def __post_init__(self) -> None:
        if self.units == 0:
            object.__setattr__(self, "units", self.threads * SHARES_PER_CORE if self.resource == "cpu" else 1)
        if min(self.replicas, self.batch_size, self.units, self.threads) < 1:
            raise InputError(
                "a component plan needs replicas, batch_size, units and threads >= 1; "
                f"got {self.replicas}, {self.batch_size}, {self.units}, {self.threads}"
            )
        if self.resource == "cpu" and not valid_cpu_units(self.units, self.threads):
            whole = self.threads * SHARES_PER_CORE
            raise InputError(
                f"a cpu replica of {self.threads} threads takes {whole} units (whole cores, {SHARES_PER_CORE} a core)"
                + f" or {' or '.join(map(str, lending_units(self.threads)))} (part of its last core lent)"
                + f", or with 1 thread {' or '.join(map(str, SHARE_SIZES))} units of a shared core; got units={self.units}"
            )

    @property
    def shared(self) -> bool:
        """Whether a replica runs on a core it shares with others (a CPU replica of a share)."""
        return self.resource == "cpu" and self.threads == 1 and self.units in SHARE_SIZES

    @property
    def cores(self) -> float:
        """Cores one replica takes on "cpu" (a fraction when shared), GPUs on "gpu"."""
        return self.units / SHARES_PER_CORE if self.resource == "cpu" else self.units


@dataclass(frozen=True)
class Plan:
    """Per component (by its deployed name) its `ComponentPlan`, with the requests/s predicted.

    Made by `patchkit.plan()` or by hand; applied by `deploy(plan=...)`; `print(plan)` shows its table.

    Attributes:
        components: each component's `ComponentPlan`, by its deployed name.
        throughput: requests/s the pipeline (several: their mix, by `weights`) sustains, predicted.
        bottleneck: the component that limits it.
        solver: what made the plan: the MILP solver's name, or "manual".
        capacity: the pool planned for, cores and GPUs by resource type.
        virtual: resource types the machine lacks: their replicas run on virtual devices.
        slo_ms: the latency target the batch sizes were chosen to fit, if any.
        weights: each pipeline's share of the requests it was planned for (summing to 1), with several
            pipelines; empty for one.
    """

    components: Mapping[str, ComponentPlan]
    throughput: float  # requests/s the pipeline (several: their mix, by `weights`) sustains, predicted
    bottleneck: str
    solver: str = "manual"
    capacity: Mapping[str, int] = field(default_factory=dict)  # the pool planned for: cores and GPUs
    virtual: tuple[str, ...] = ()  # resource types the machine lacks: their replicas run on virtual devices
    slo_ms: float | None = None
    # each pipeline's share of the requests it was planned for (summing to 1), with several pipelines; {}: one
    weights: Mapping[str, float] = field(default_factory=dict)

    def used(self) -> dict[str, float]:
        """Cores and GPUs the plan gives its replicas, per type: CPU in eighths of a core, lent parts not counted."""
        used: dict[str, float] = {}
        for c in self.components.values():
            used[c.resource] = used.get(c.resource, 0) + c.replicas * c.cores
        return used

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-able data, what `patchkit plan --json` prints and `from_dict` reads.

        Returns:
            `{"components": {NAME: {"resource", "replicas", "batch_size", "throughput", ...}}, "throughput",
            "bottleneck", "weights": {PIPELINE: share}, ...}`.
        """
        return {
            "components": {name: asdict(c) for name, c in self.components.items()},
            "throughput": self.throughput,
            "bottleneck": self.bottleneck,
            "solver": self.solver,
            "capacity": dict(self.capacity),
            "used": self.used(),
            "virtual": list(self.virtual),
            "slo_ms": self.slo_ms,
            "weights": dict(self.weights),
            "shares_per_core": SHARES_PER_CORE,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """A plan saved with `to_dict()`, as `patchkit plan --json` prints it.

        Args:
            data: what `to_dict()` returned, or an older patchkit's (no threads: a CPU replica's units were
                whole cores; or another number of shares a core).

        Returns:
            The plan.

        Raises:
            InputError: `data` is not a plan.
        """
        try:
            per_core = int(data.get("shares_per_core", SHARES_PER_CORE))
            components = {name: ComponentPlan(**_current(c, per_core)) for name, c in data["components"].items()}
            return cls(
                components, float(data["throughput"]), str(data["bottleneck"]), str(data.get("solver", "manual")),
                dict(data.get("capacity", {})), tuple(data.get("virtual", ())), data.get("slo_ms"),
                {str(name): float(w) for name, w in data.get("weights", {}).items()},
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
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
                _threads(c),
                f"{c.visits:.2f}",
                f"{c.throughput:.1f}",
            ))
        header = ("component", "resource", "replicas", "default batch", "batch", "threads", "visits", "calls/s")
        used = ", ".join(f"{kind} {n:g}/{self.capacity.get(kind, n):g}" for kind, n in sorted(self.used().items()))
        lines = [
            text_table(header, rows, left=2),
            f"predicted {self.throughput:.1f} requests/s; bottleneck {self.bottleneck}; uses {used}; solver {self.solver}",
        ]
        if self.weights:
            mix = ", ".join(f"{name} {100 * share:.0f}%" for name, share in self.weights.items())
            lines.append(f"planned for this mix of requests: {mix}")
        if self.virtual:
            lines.append(f"virtual devices (this machine has too few): {', '.join(self.virtual)}")
        for name, c in self.components.items():
            if c.model_error is not None:
                lines.append(f"{name}: planned from its cost model, within {100 * c.model_error:.1f}% of measured whole calls")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        import html

        return f"<pre>{html.escape(self.table())}</pre>"


def _current(component: Mapping[str, Any], per_core: int) -> dict[str, Any]:
    """A component's saved plan in today's fields.

    Before `threads`, a CPU replica's units were its cores; a plan counting `per_core` shares a core has its CPU units counted
    again in today's.
    """
    fields = dict(component)
    if fields.get("resource") != "cpu":
        return fields
    if "threads" not in fields:
        cores = int(fields.get("units", 1))
        fields.update(threads=cores, units=cores * SHARES_PER_CORE)
    elif per_core != SHARES_PER_CORE and "units" in fields:
        fields["units"] = int(fields["units"]) * SHARES_PER_CORE // per_core
    return fields


def _threads(c: ComponentPlan) -> str:
    """The table's threads cell: a replica's threads, or its share of a core."""
    if c.resource != "cpu":
        return "-"
    if c.shared:
        return f"1 on {c.units}/{SHARES_PER_CORE} core"
    lent = lent_shares(c.units)
    return f"{c.threads}, {lent}/{SHARES_PER_CORE} core lent" if lent else str(c.threads)
