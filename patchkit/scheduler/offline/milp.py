"""The planner's MILP: per component, a resource type, its units (threads or a share of a core), a batch size
and a replica count.

Patchwork (section 3.3) maximises the pipeline's throughput as a concurrent flow: every component
must process its share of requests, and the slowest one sets the rate. Here it reads:

    maximise    L                                           requests/s of the pipeline
    subject to  sum_{o,b} z[i,o,b] = 1                           for each component i
                z[i,o,b] <= n[i,o,b] <= min(R_k(o) // r[o], m[o]) * z[i,o,b]
                sum_{o,b} n[i,o,b] * 1000 b / T_o(b) >= visits_i * L      for each component i
                sum_{i,o on k,b} n[i,o,b] * r[o] <= R_k                      for each resource type k
                sum_{i,o on k,b} n[i,o,b] * r_s[o] <= d_k floor(R_k / d_k)   for each k with options holding cores, each s
                sum_{i,o,b} visits_i * 2 T_o(b) * z[i,o,b] <= slo_ms         with an SLO
                z binary, n integer, L >= 0

i ranges over components, o over a component's `Option`s, b over candidate batch sizes; z picks one
(o, b) per component, n counts its replicas. An option is a resource type k(o) and the units r[o]
one replica takes of it, with the latency T_o profiled there: a component may have several options
on one type, differing in units (a CPU replica of 1, 2 or 4 threads, or a share of a core; the
planner's docstring says how CPU units are counted), and m[o] may cap its replicas (a share of a
core is for a component that needs less than a core: one replica). R_k is the units there are. T_o(b) is the
fitted milliseconds per batch, so one replica serves 1000 b / T_o(b) calls/s when its queue keeps
it busy. A CPU replica of whole cores holds h[o] of them (d_k units a core), lending l[o] = d_k h[o] - r[o]
units of its last one to share replicas (h[o] = 0 for those). The rows over s (each share size above 1,
and d_k) say the replicas can be placed: share replicas of s units or more fit the rooms of s or more,
the free cores and the lent parts; r_s[o] is r[o] for a share replica of s or more (else 0), and
d_k h[o], less l[o] when l[o] >= s, for a replica holding cores. The row at d_k keeps the cores held
within the cores there are; the units row is the one at s = 1. With sizes in powers of two, these
rows hold exactly when first fit decreasing places every replica (orchestrator/resources.py).

Candidate batch sizes. Along one linear segment of T, with T(b) = a + s b, the throughput
b / (a + s b) is monotone in b (rising when a > 0), so without an SLO the best batch of a segment is
one of its ends: the candidates are 1, the breakpoints (rounded both ways) and max_batch, all within
[1, max_batch], and the plan is optimal over every integer batch size. With an SLO the per-request
latency is estimated as visits_i * 2 T_i(b_i) summed over components (a call waits for the batch in
progress, then runs in the next); each option also gets the largest batch that meets the SLO when
every other component runs at its fastest, and candidates that cannot meet it are dropped. The plan
is then optimal among these candidates.

A candidate that another beats on both latency and calls/s is left out of the model (without an SLO
only the batch of most calls/s stays, the smallest where they tie): it could not serve a plan better.

Before branching, the LP relaxation bounds L, and each pair's replicas by what reaches that bound
(a few rounds, each relaxation tighter than the last): no optimal plan is cut off, and HiGHS, whose
branch and bound otherwise starts far from the optimum, solves several times faster.

Among plans within a relative 1e-6 of the best L, the one using the fewest resource units in total
wins, and of those the one with the fewest replicas (each loads its own copy of the component): a
second solve fixes L and minimises units * (U + 1) + replicas, U the units there are, which no
count of replicas (each takes a unit or more) can outweigh. A replica holding cores counts them
whole, the part it lends included, and a lending replica counts 1 / (U + 1) more than a replica: a
part of a core is lent only where the plan's throughput needs it, never to no one.

Solvers (`solvers.py`): gurobipy when importable and its licence takes the model (the pip licence stops
at 2,000 variables and 2,000 constraints), else HiGHS through highspy; `pip install 'patchkit[sched]'`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from patchkit.errors import PlanError
from patchkit.scheduler.offline.pwl import PiecewiseLinear
from patchkit.scheduler.offline.solvers import GurobiUnavailable, LinearModel, Solver, solve_gurobi, solve_highs

__all__ = ["Choice", "Option", "Problem", "Solution", "candidate_batches", "solve"]

logger = logging.getLogger(__name__)

SOLVERS = ("auto", "gurobi", "highs")
UNITS_SLACK = 1e-6  # relative throughput given up, at most, to use fewer resource units


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


def solve(problem: Problem, *, solver: str = "auto") -> Solution:
    """The throughput-maximising plan of `problem`; called by `patchkit.plan()` after profiling.

    `solver`: "auto" (gurobi when it is installed and its licence takes the model, else HiGHS),
    "gurobi" or "highs". Raises `PlanError` when no plan fits the resources or the SLO, saying what
    is missing.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(map(repr, SOLVERS))}; got {solver!r}")
    _check_feasible(problem)
    candidates = candidate_batches(problem)
    model = _Model.build(problem, candidates)
    started = time.perf_counter()
    name, values = _run(model, solver)
    if values is None:
        raise PlanError(_infeasible_message(problem))
    choices = _read(problem, model, values)
    solution = _solution(problem, choices, name)
    logger.info(
        "solved with %s in %.3f s (%d variables, %d constraints): %.6g requests/s, bottleneck %s",
        name, time.perf_counter() - started, model.columns, len(model.rows), solution.throughput, solution.bottleneck,
    )
    return solution


def candidate_batches(problem: Problem) -> dict[tuple[str, str, int], tuple[int, ...]]:
    """Candidate batch sizes of every usable option, by `Option.key`, ascending.

    An option is usable when its resource has units enough for one replica; with an SLO only batch
    sizes that can meet it remain, and an option left with none is dropped.
    """
    fastest = {name: _fastest(problem, name)[0] for name in problem.visits}
    found = {}
    for option in _usable(problem):
        latency, top = option.latency, option.max_batch
        sizes = _segment_ends(option)
        for size in sizes:
            if latency(size) <= 0:
                raise ValueError(
                    f"{option.component} on {option.resource}: T({size}) is {latency(size)} ms; a batch must take > 0 ms"
                )
        if problem.slo_ms is not None:
            visits = problem.visits[option.component]
            others = sum(problem.visits[name] * 2 * ms for name, ms in fastest.items() if name != option.component)
            bound = (problem.slo_ms - others) / (2 * visits)
            largest = latency.largest_within(bound * (1 + 1e-12), 1, top)
            if largest is not None:
                sizes.add(largest)
            sizes = {b for b in sizes if latency(b) <= bound * (1 + 1e-12)}
        kept = _undominated(latency, sizes)
        if kept:
            found[option.key] = kept if problem.slo_ms is not None else kept[-1:]
    return found


def _undominated(latency: PiecewiseLinear, sizes: set[int]) -> tuple[int, ...]:
    """The sizes no other size beats on both latency and calls/s, by ascending latency (and calls/s).

    A dominated size cannot serve a plan better, so the model leaves it out; where calls/s tie, the
    quicker (smaller) batch stays. Without an SLO only the last, the most calls/s, matters.
    """
    kept: list[int] = []
    most = 0.0
    for b in sorted(sizes, key=lambda b: (latency(b), b)):
        calls = b / latency(b)
        if calls > most * (1 + 1e-12):
            kept.append(b)
            most = calls
    return tuple(kept)


def _usable(problem: Problem) -> list[Option]:
    return [o for o in problem.options if problem.capacity.get(o.resource, 0) >= o.units]


def _segment_ends(option: Option) -> set[int]:
    """1, max_batch and the breakpoints rounded down and up, within [1, max_batch]: the integer batch
    sizes at the ends of T's linear pieces, where both the most calls/s and the least latency lie."""
    rounded = {f(x) for x in option.latency.breakpoints for f in (math.floor, math.ceil)}
    return {1, option.max_batch} | {min(max(b, 1), option.max_batch) for b in rounded}


def _fastest(problem: Problem, component: str) -> tuple[float, int, str]:
    """(ms, batch, resource) of the component's quickest batch over its usable options."""
    best = (math.inf, 0, "")
    for option in _usable(problem):
        if option.component == component:
            best = min(best, *((option.latency(b), b, option.resource) for b in _segment_ends(option)))
    return best


# -- infeasibility, said before solving ------------------------------------------------------------
def _check_feasible(problem: Problem) -> None:
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
        kinds = _least_units([o for o in _usable(problem) if o.component == name])
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
        fastest = {name: _fastest(problem, name) for name in problem.visits}
        least = sum(problem.visits[name] * 2 * ms for name, (ms, _, _) in fastest.items())
        if least > problem.slo_ms * (1 + 1e-12):
            parts = ", ".join(
                f"{name}: {problem.visits[name]:g} x 2 x {ms:.3g} ms at batch {b} on {kind}"
                for name, (ms, b, kind) in fastest.items()
            )
            raise PlanError(
                f"no batch size meets slo_ms={problem.slo_ms:g}: a request takes at least {least:.3g} ms even with "
                f"every component at its fastest batch ({parts}); raise slo_ms or use faster components"
            )


def _least_units(options: Sequence[Option]) -> dict[str, int]:
    """The fewest units one replica takes, per resource type, over `options`."""
    least: dict[str, int] = {}
    for o in options:
        least[o.resource] = min(least.get(o.resource, o.units), o.units)
    return least


# -- the model, solver-neutral ---------------------------------------------------------------------
@dataclass
class _Model(LinearModel):
    """Columns [L, z0, n0, z1, n1, ...], one (z, n) pair per (option, batch size) in `pairs`."""

    pairs: list[tuple[Option, int]]
    units: list[float]  # objective of the second solve: resource units taken (weighted), then replicas
    visits: Mapping[str, float]
    most_rows: list[int]  # per pair, the row n - most * z <= 0

    def limit_replicas(self, pair: int, most: int) -> None:
        """Bound the replicas of one (option, batch size) pair to `most`."""
        self.upper[2 + 2 * pair] = float(most)
        self.rows[self.most_rows[pair]][1][1] = -float(most)

    @classmethod
    def build(cls, problem: Problem, candidates: Mapping[tuple[str, str, int], tuple[int, ...]]) -> _Model:
        pairs = [(o, b) for o in _usable(problem) for b in candidates.get(o.key, ())]
        weight = 1.0 + sum(problem.capacity.values())  # a unit outweighs any count of replicas
        lower, upper, integer, units = [0.0], [math.inf], [False], [0.0]
        rows: list[tuple[list[int], list[float], float, float]] = []
        most_rows = []
        pick: dict[str, list[int]] = {name: [] for name in problem.visits}
        serve: dict[str, tuple[list[int], list[float]]] = {name: ([0], [-problem.visits[name]]) for name in problem.visits}
        use: dict[str, tuple[list[int], list[float]]] = {}
        slo: tuple[list[int], list[float]] = ([], [])
        best = dict.fromkeys(problem.visits, 0.0)  # an upper bound on each component's calls/s
        for p, (option, b) in enumerate(pairs):
            z, n = 1 + 2 * p, 2 + 2 * p
            most = min(problem.capacity[option.resource] // option.units, option.most_replicas or math.inf)
            lower += [0.0, 0.0]
            upper += [1.0, float(most)]
            integer += [True, True]
            held = _held(option, problem)
            units += [0.0, weight * held + 1.0 + (1 / weight if held > option.units else 0.0)]
            rows.append(([n, z], [1.0, -1.0], 0.0, math.inf))
            most_rows.append(len(rows))
            rows.append(([n, z], [1.0, -float(most)], -math.inf, 0.0))
            pick[option.component].append(z)
            calls = 1000 * b / option.latency(b)
            serve[option.component][0].append(n)
            serve[option.component][1].append(calls)
            best[option.component] = max(best[option.component], most * calls)
            used = use.setdefault(option.resource, ([], []))
            used[0].append(n)
            used[1].append(float(option.units))
            slo[0].append(z)
            slo[1].append(problem.visits[option.component] * 2 * option.latency(b))
        upper[0] = min(best[name] / problem.visits[name] for name in problem.visits)
        rows += [(columns, [1.0] * len(columns), 1.0, 1.0) for columns in pick.values()]
        rows += [(columns, coefficients, 0.0, math.inf) for columns, coefficients in serve.values()]
        for kind, (columns, coefficients) in use.items():
            rows.append((columns, coefficients, -math.inf, float(problem.capacity[kind])))
        rows += _room_rows(problem, pairs)
        if problem.slo_ms is not None:
            rows.append((slo[0], slo[1], -math.inf, problem.slo_ms))
        return cls(lower, upper, integer, rows, pairs, units, problem.visits, most_rows)


def _held(option: Option, problem: Problem) -> int:
    """The units one replica of `option` keeps from others: a replica holding cores holds them whole."""
    per_declared = problem.per_declared.get(option.resource)
    return option.units if not option.holds or per_declared is None else option.holds * per_declared


def _room_rows(problem: Problem, pairs: Sequence[tuple[Option, int]]) -> list[tuple[list[int], list[float], float, float]]:
    """The rows r_s (see the module's docstring): per resource type with options holding whole declared
    units, for each share size s above 1 and the declared unit d, replicas of s units or more within
    the rooms of s or more."""
    rows = []
    for kind, d in problem.per_declared.items():
        on = [(2 + 2 * p, option) for p, (option, _) in enumerate(pairs) if option.resource == kind]
        if d <= 1 or not any(option.holds for _, option in on):
            continue
        room = float(problem.capacity[kind] // d * d)
        for s in sorted({o.units for _, o in on if not o.holds and 1 < o.units < d} | {d}):
            taken = [(n, _taken(o, s, d)) for n, o in on]
            rows.append(([n for n, r in taken if r], [float(r) for _, r in taken if r], -math.inf, room))
    return rows


def _taken(option: Option, size: int, per_declared: int) -> int:
    """r_s[o]: the units of rooms of `size` or more one replica of `option` takes. A replica holding cores
    takes them whole, unless the part it lends is itself such a room."""
    if not option.holds:
        return option.units if option.units >= size else 0
    whole = option.holds * per_declared
    return option.units if whole - option.units >= size else whole


def _run(model: _Model, solver: str) -> tuple[str, list[float] | None]:
    """Solve twice (most throughput, then fewest units at that throughput); returns (solver, values)."""
    if solver in ("auto", "gurobi"):
        try:
            return "gurobi", _two_stages(model, solve_gurobi)
        except GurobiUnavailable as exc:
            if solver == "gurobi":
                raise PlanError(f"solver='gurobi' cannot solve this plan: {exc}; use solver='highs' or 'auto'") from None
            logger.info("gurobi unavailable (%s); solving with HiGHS", exc)
    if importlib.util.find_spec("highspy") is None:
        raise PlanError("planning needs a MILP solver: pip install 'patchkit[sched]' (highspy, and gurobipy if licensed)")
    return "highs", _two_stages(model, solve_highs)


def _two_stages(model: _Model, backend: Solver) -> list[float] | None:
    """Most throughput, then fewest units within UNITS_SLACK of it; None when nothing is feasible."""
    _tighten(model, backend)
    throughput = [1.0] + [0.0] * (model.columns - 1)
    first = backend(model, throughput, True, None)
    if first is None:
        return None
    reached = _exact_throughput(model, first)
    bound = model.lower[0]
    model.lower[0] = reached * (1 - UNITS_SLACK)
    try:
        second = backend(model, model.units, False, first)
    finally:
        model.lower[0] = bound
    return first if second is None else second


def _tighten(model: _Model, backend: Solver, rounds: int = 5) -> None:
    """Bound L and every pair's replicas by the LP relaxation, so that branch and bound starts closer.

    No plan beats the relaxation's L, and no pair needs more replicas than reach it, so no optimal
    plan (of either solve) is cut off. Each round's smaller bounds can lower the next relaxation.
    """
    relaxed = dataclasses.replace(model, integer=[False] * model.columns)  # shares the bounds and rows
    throughput = [1.0] + [0.0] * (model.columns - 1)
    for _ in range(rounds):
        values = backend(relaxed, throughput, True, None)
        if values is None:
            return  # the MILP is infeasible too, and its solve says so
        bound = values[0] * (1 + 1e-6)  # above the solver's tolerances
        model.upper[0] = min(model.upper[0], bound)
        tightened = False
        for p, (option, b) in enumerate(model.pairs):
            need = max(math.ceil(model.visits[option.component] * bound * option.latency(b) / (1000 * b)), 1)
            if need < model.upper[2 + 2 * p]:
                model.limit_replicas(p, need)
                tightened = True
        if not tightened:
            return


def _infeasible_message(problem: Problem) -> str:
    # The pre-checks look at one resource type at a time; what is left is components that could use
    # several types competing for too few units of all of them, or an SLO met only on a full type.
    needs = []
    for name in problem.visits:
        ways = [f"{units} {kind}" for kind, units in _least_units([o for o in _usable(problem) if o.component == name]).items()]
        needs.append(f"{name}: {' or '.join(ways)}")
    declared = ", ".join(f"{kind!r}: {problem.declared(kind, units)}" for kind, units in problem.capacity.items())
    slo = f" within slo_ms={problem.slo_ms:g}" if problem.slo_ms is not None else ""
    return (
        f"no placement gives each of the {len(problem.visits)} components a replica{slo}: one replica takes "
        f"{'; '.join(needs)}, and resources={{{declared}}} are declared; declare more"
    )


def _chosen(model: _Model, values: Sequence[float]) -> list[tuple[Option, int, int]]:
    """(option, batch, replicas) of each component in a solver's answer."""
    return [
        (option, b, round(values[2 + 2 * p]))
        for p, (option, b) in enumerate(model.pairs)
        if values[1 + 2 * p] > 0.5
    ]


def _exact_throughput(model: _Model, values: Sequence[float]) -> float:
    """L of an answer recomputed from its integers, free of the solver's tolerances."""
    served = {option.component: replicas * 1000 * b / option.latency(b) for option, b, replicas in _chosen(model, values)}
    return min(served[name] / visits for name, visits in model.visits.items())


def _read(problem: Problem, model: _Model, values: Sequence[float]) -> dict[str, Choice]:
    """Each component's Choice, in the order of `problem.visits`."""
    chosen = {option.component: (option, b, replicas) for option, b, replicas in _chosen(model, values)}
    choices = {}
    for name in problem.visits:
        option, b, replicas = chosen[name]
        batch_ms = option.latency(b)
        calls = replicas * 1000 * b / batch_ms
        choices[name] = Choice(name, option.resource, replicas, b, calls, option.units, batch_ms, option.threads)
    return choices


def _solution(problem: Problem, choices: dict[str, Choice], solver: str) -> Solution:
    rates = {name: choice.throughput / problem.visits[name] for name, choice in choices.items()}
    bottleneck = min(rates, key=rates.__getitem__)
    used: dict[str, int] = {}
    for choice in choices.values():
        used[choice.resource] = used.get(choice.resource, 0) + choice.replicas * choice.units
    latency = sum(problem.visits[name] * 2 * choice.batch_ms for name, choice in choices.items())
    return Solution(choices, rates[bottleneck], bottleneck, solver, used, latency)
