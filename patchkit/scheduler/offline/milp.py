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

The `Problem` it is given and the `Solution` it returns are `problem.py`'s. Candidate batch sizes
(`candidates.py`): the ends of T's linear pieces, and with an SLO the largest batch that meets it;
without an SLO the plan is then optimal over every integer batch size, with one among these
candidates. The checks that name, before solving, the resource or SLO no plan can meet are
`feasibility.py`'s.

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
at 2,000 variables and 2,000 constraints), else HiGHS through highspy; `pip install -e '.[sched]'` brings both.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from patchkit.errors import PlanError
from patchkit.scheduler.offline.candidates import candidate_batches, usable
from patchkit.scheduler.offline.feasibility import check_feasible, infeasible_message
from patchkit.scheduler.offline.problem import Choice, Option, Problem, Solution
from patchkit.scheduler.offline.solvers import GurobiUnavailable, LinearModel, Solver, solve_gurobi, solve_highs

__all__ = ["solve"]

logger = logging.getLogger(__name__)

SOLVERS = ("auto", "gurobi", "highs")
UNITS_SLACK = 1e-6  # relative throughput given up, at most, to use fewer resource units


def solve(problem: Problem, *, solver: str = "auto") -> Solution:
    """The throughput-maximising plan of `problem`; called by `patchkit.plan()` after profiling.

    `solver`: "auto" (gurobi when it is installed and its licence takes the model, else HiGHS),
    "gurobi" or "highs". Raises `PlanError` when no plan fits the resources or the SLO, saying what
    is missing.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(map(repr, SOLVERS))}; got {solver!r}")
    check_feasible(problem)
    candidates = candidate_batches(problem)
    model = _Model.build(problem, candidates)
    started = time.perf_counter()
    name, values = _run(model, solver)
    if values is None:
        raise PlanError(infeasible_message(problem))
    choices = _read(problem, model, values)
    solution = _solution(problem, choices, name)
    logger.info(
        "solved with %s in %.3f s (%d variables, %d constraints): %.6g requests/s, bottleneck %s",
        name, time.perf_counter() - started, model.columns, len(model.rows), solution.throughput, solution.bottleneck,
    )
    return solution


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
        pairs = [(o, b) for o in usable(problem) for b in candidates.get(o.key, ())]
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
        raise PlanError("planning needs a MILP solver: pip install -e '.[sched]' in patchkit's checkout "
                        "(highspy, and gurobipy if licensed)")
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
