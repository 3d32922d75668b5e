"""Why no plan fits, said in words a user can act on: which component cannot get a replica, which
resource type is short and by how much, or which SLO no batch size can meet.

`milp.solve` calls `check_feasible` before it builds the model, so that the obvious shortfalls are
named precisely (one resource type at a time, and the SLO at every component's fastest batch), and
`infeasible_message` when the solver finds no plan all the same.
"""

from __future__ import annotations

from collections.abc import Sequence

from patchkit.errors import PlanError
from patchkit.scheduler.offline.candidates import fastest, usable
from patchkit.scheduler.offline.problem import Option, Problem

__all__ = ["check_feasible", "infeasible_message"]


def check_feasible(problem: Problem) -> None:
    """Raise PlanError naming what is missing when the obvious needs exceed the resources."""
    for name in problem.visits:
        options = [o for o in problem.options if o.component == name]
        if not options:
            raise PlanError(f"{name} has no option: it was profiled on no resource type, so no replica of it can be placed")
        if not any(problem.capacity.get(o.resource, 0) >= o.units for o in options):
            fewest = _least_units(options)
            reasons = [f"{kind} ({n} units a replica, {problem.capacity.get(kind, 0)} there are)" for kind, n in fewest.items()]
            more = ", ".join(f"{kind!r}: {problem.declared(kind, units)}" for kind, units in fewest.items())
            raise PlanError(
                f"{name} cannot get one replica: it runs on {' or '.join(reasons)}; declare more with resources={{{more}}}"
            )
    only: dict[str, dict[str, int]] = {}  # resource type -> components that can run nowhere else -> units
    for name in problem.visits:
        kinds = _least_units([o for o in usable(problem) if o.component == name])
        if len(kinds) == 1:
            [(kind, units)] = kinds.items()
            only.setdefault(kind, {})[name] = units
    for kind, needs in only.items():
        total, capacity = sum(needs.values()), problem.capacity[kind]
        if total > capacity:
            if all(units == 1 for units in needs.values()):
                what = f"{len(needs)} components need a {kind} replica each ({', '.join(needs)})"
            else:
                listed = ", ".join(f"{name}: {units}" for name, units in needs.items())
                what = f"{len(needs)} components need {total} {kind} units for a replica each ({listed})"
            enough = problem.declared(kind, total)
            raise PlanError(f"{what} but {kind} has {capacity} units; declare more with resources={{{kind!r}: {enough}}}")
    if problem.slo_ms is not None:
        quickest = {name: fastest(problem, name) for name in problem.visits}
        least = sum(problem.visits[name] * 2 * ms for name, (ms, _, _) in quickest.items())
        if least > problem.slo_ms * (1 + 1e-12):
            parts = ", ".join(
                f"{name}: {problem.visits[name]:g} x 2 x {ms:.3g} ms at batch {b} on {kind}"
                for name, (ms, b, kind) in quickest.items()
            )
            raise PlanError(
                f"no batch size meets slo_ms={problem.slo_ms:g}: a request takes at least {least:.3g} ms even with "
                f"every component at its fastest batch ({parts}); raise slo_ms or use faster components"
            )


def infeasible_message(problem: Problem) -> str:
    """What each component needs for one replica against what is declared, for when the solver finds no plan."""
    # The pre-checks look at one resource type at a time; what is left is components that could use
    # several types competing for too few units of all of them, or an SLO met only on a full type.
    needs = []
    for name in problem.visits:
        ways = [f"{units} {kind}" for kind, units in _least_units([o for o in usable(problem) if o.component == name]).items()]
        needs.append(f"{name}: {' or '.join(ways)}")
    declared = ", ".join(f"{kind!r}: {problem.declared(kind, units)}" for kind, units in problem.capacity.items())
    slo = f" within slo_ms={problem.slo_ms:g}" if problem.slo_ms is not None else ""
    return (
        f"no placement gives each of the {len(problem.visits)} components a replica{slo}: one replica takes "
        f"{'; '.join(needs)}, and resources={{{declared}}} are declared; declare more"
    )


def _least_units(options: Sequence[Option]) -> dict[str, int]:
    """The fewest units one replica takes, per resource type, over `options`."""
    least: dict[str, int] = {}
    for o in options:
        least[o.resource] = min(least.get(o.resource, o.units), o.units)
    return least
