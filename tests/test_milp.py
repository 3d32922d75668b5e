"""The planner's MILP: Patchwork's worked example, agreement with exhaustive search on random small
instances, infeasibility said plainly, and the fall-back from gurobi's size-limited licence to HiGHS.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import math
import random
from collections import Counter
from collections.abc import Iterator

import pytest

from patchkit.errors import PlanError
from patchkit.orchestrator.resources import SHARE_SIZES, SHARES_PER_CORE, assign, lending_units, lent_shares
from patchkit.scheduler.offline.milp import solve
from patchkit.scheduler.offline.planner import options_of
from patchkit.scheduler.offline.problem import Option, Problem, Solution
from patchkit.scheduler.offline.profiler import ComponentProfile, MethodProfile
from patchkit.scheduler.offline.pwl import PiecewiseLinear

HAVE_GUROBI = importlib.util.find_spec("gurobipy") is not None
SOLVERS = [
    "highs",
    pytest.param("gurobi", marks=pytest.mark.skipif(not HAVE_GUROBI, reason="gurobipy is not installed")),
]


def line(intercept: float, slope: float, top: float) -> PiecewiseLinear:
    """T(b) = intercept + slope * b, as two breakpoints."""
    return PiecewiseLinear((1.0, top), (intercept + slope, intercept + slope * top))


# -- Patchwork's example (section 2.3): 5 CPUs, 2 GPUs ----------------------------------------------------
def rag(retriever: PiecewiseLinear) -> Problem:
    return Problem(
        options=(
            Option("retriever", "cpu", 1, retriever, 64),
            Option("augmenter", "cpu", 1, line(0, 1, 64), 64),  # 1 ms per item
            Option("generator", "gpu", 1, line(10, 0, 70), 70),  # 10 ms per batch up to 70
        ),
        visits={"retriever": 1.0, "augmenter": 1.0, "generator": 1.0},
        capacity={"cpu": 5, "gpu": 2},
    )


def placement(solution: Solution) -> dict[str, tuple[str, int]]:
    return {name: (c.resource, c.replicas) for name, c in solution.choices.items()}


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_retriever_that_costs_per_query_gets_three_cpus(solver: str) -> None:
    solution = solve(rag(line(0, 2, 64)), solver=solver)  # Qdrant-like: 2 ms per query
    assert placement(solution) == {"retriever": ("cpu", 3), "augmenter": ("cpu", 2), "generator": ("gpu", 1)}
    assert solution.choices["generator"].batch_size == 70
    assert solution.throughput == pytest.approx(1500.0)  # 0.5 queries/ms per retriever replica, times 3
    assert solution.bottleneck == "retriever" and solution.solver == solver
    assert solution.used == {"cpu": 5, "gpu": 1}  # the second GPU would add nothing


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_retriever_that_batches_for_free_moves_the_cpus_to_the_augmenter(solver: str) -> None:
    solution = solve(rag(line(2, 0, 64)), solver=solver)  # Chroma-like: 2 ms per batch
    assert placement(solution) == {"retriever": ("cpu", 1), "augmenter": ("cpu", 4), "generator": ("gpu", 1)}
    assert solution.choices["retriever"].batch_size == 64 and solution.choices["generator"].batch_size == 70
    assert solution.throughput == pytest.approx(4000.0)
    assert solution.bottleneck == "augmenter" and solution.used == {"cpu": 5, "gpu": 1}


def test_visits_scale_a_components_share() -> None:
    problem = rag(line(0, 2, 64))
    looping = Problem(problem.options, {**problem.visits, "augmenter": 3.0}, problem.capacity)
    solution = solve(looping, solver="highs")  # three augmenter calls per request: r + a = 5
    assert placement(solution)["augmenter"] == ("cpu", 3)  # min(0.5 r, a / 3): r = 2, a = 3 gives 1.0 vs 0.67
    assert solution.throughput == pytest.approx(1000.0)


@pytest.mark.parametrize("solver", SOLVERS)
def test_an_slo_caps_the_batch_size(solver: str) -> None:
    options = (Option("retriever", "cpu", 1, line(1, 0, 64), 64), Option("generator", "gpu", 1, line(5, 0.5, 64), 64))
    problem = Problem(options, {"retriever": 1.0, "generator": 1.0}, {"cpu": 1, "gpu": 1})
    assert solve(problem, solver=solver).choices["generator"].batch_size == 64
    # 2 x (1 + 5 + 0.5 b) <= 32 leaves the generator batches of at most 20.
    solution = solve(Problem(options, problem.visits, problem.capacity, slo_ms=32.0), solver=solver)
    assert solution.choices["generator"].batch_size == 20 and solution.latency_ms == pytest.approx(32.0)
    assert solution.throughput == pytest.approx(20 * 1000 / 15) and solution.bottleneck == "generator"


# -- random small instances against exhaustive search --------------------------------------------
def random_curve(rng: random.Random, top: int) -> PiecewiseLinear:
    while True:
        xs = sorted(rng.sample(range(1, int(top * 1.3) + 2), rng.randint(1, 3)))
        if rng.random() < 0.3:
            xs = sorted({x + rng.choice((0.0, 0.5)) for x in xs})  # a breakpoint between batch sizes
        values = [rng.uniform(0.5, 20.0)]
        for _ in xs[1:]:
            values.append(values[-1] + rng.choice((0.0, rng.uniform(-2.0, 10.0))))
        if min(values) <= 0:
            continue
        curve = PiecewiseLinear(tuple(map(float, xs)), tuple(values))
        if min(curve(b) for b in range(1, top + 1)) > 0.1:
            return curve


def random_problem(rng: random.Random) -> Problem:
    kinds = ["cpu", "gpu"][: rng.randint(1, 2)]
    capacity = {kind: rng.randint(1, 4) for kind in kinds}
    names = [f"c{i}" for i in range(rng.randint(2, 4))]
    options = []
    for name in names:
        for kind in rng.sample(kinds, rng.randint(1, len(kinds))):
            # sometimes two options on one type, differing in units (a share of a core, or more threads)
            for units in rng.sample((1, 2, 3), rng.choice((1, 1, 2))):
                top, most = rng.randint(2, 40), rng.choice((None, None, 1))
                options.append(Option(name, kind, units, random_curve(rng, top), top, most_replicas=most))
    visits = {name: rng.choice((1.0, rng.uniform(0.2, 3.0))) for name in names}
    problem = Problem(tuple(options), visits, capacity)
    if rng.random() < 0.4:  # an SLO between the fastest batches' latency and three times it
        fastest = sum(
            visits[name] * 2 * min(o.latency(b) for o in options if o.component == name for b in range(1, o.max_batch + 1))
            for name in names
        )
        problem = Problem(problem.options, visits, capacity, slo_ms=fastest * rng.uniform(1.0, 3.0))
    return problem


def assignments(problem: Problem, batches: dict[tuple[str, str, int], tuple[int, ...]]) -> Iterator[tuple[float, int]]:
    """(requests/s, units) of every plan that fits: each component on one option, batch and count."""
    per_component = {
        name: [
            (o, b, n)
            for o in problem.options if o.component == name and o.key in batches
            for b in batches[o.key]
            for n in range(1, min(problem.capacity[o.resource] // o.units, o.most_replicas or 99) + 1)
        ]
        for name in problem.visits
    }
    for plan in itertools.product(*per_component.values()):
        used: dict[str, int] = {}
        for o, _, n in plan:
            used[o.resource] = used.get(o.resource, 0) + n * o.units
        if any(units > problem.capacity[kind] for kind, units in used.items()):
            continue
        if problem.slo_ms is not None:
            latency = sum(problem.visits[o.component] * 2 * o.latency(b) for o, b, _ in plan)
            if latency > problem.slo_ms * (1 + 1e-9):
                continue
        rate = min(n * 1000 * b / o.latency(b) / problem.visits[o.component] for o, b, n in plan)
        yield rate, sum(used.values())


def exhaustive(problem: Problem, batches: dict[tuple[str, str, int], tuple[int, ...]]) -> tuple[float, int] | None:
    """The best requests/s and the fewest units among plans within 1e-6 of it; None when none fits."""
    found = list(assignments(problem, batches))
    if not found:
        return None
    best = max(rate for rate, _ in found)
    return best, min(units for rate, units in found if rate >= best * (1 - 1e-6))


def documented_candidates(problem: Problem) -> dict[tuple[str, str, int], tuple[int, ...]]:
    """The candidate batch sizes as candidates.py's docstring states them, before it prunes dominated ones:
    1, the breakpoints rounded both ways and max_batch; with an SLO, also the largest batch that meets
    it while every other component runs at its fastest, and only sizes that can meet it."""
    usable = [o for o in problem.options if problem.capacity.get(o.resource, 0) >= o.units]
    fastest = {
        name: min((o.latency(b) for o in usable if o.component == name for b in range(1, o.max_batch + 1)), default=math.inf)
        for name in problem.visits
    }
    found = {}
    for o in usable:
        rounded = {f(x) for x in o.latency.breakpoints for f in (math.floor, math.ceil)}
        sizes = {1, o.max_batch} | {min(max(b, 1), o.max_batch) for b in rounded}
        if problem.slo_ms is not None:
            others = sum(problem.visits[name] * 2 * ms for name, ms in fastest.items() if name != o.component)
            bound = (problem.slo_ms - others) / (2 * problem.visits[o.component]) * (1 + 1e-12)
            sizes |= {max((b for b in range(1, o.max_batch + 1) if o.latency(b) <= bound), default=1)}
            sizes = {b for b in sizes if o.latency(b) <= bound}
        if sizes:
            found[o.key] = tuple(sorted(sizes))
    return found


def every_batch(problem: Problem) -> dict[tuple[str, str, int], tuple[int, ...]]:
    """Without an SLO a batch size only sets throughput: per option, the integer batch of most calls/s."""
    best = {}
    for o in problem.options:
        if problem.capacity.get(o.resource, 0) >= o.units:
            best[o.key] = (max(range(1, o.max_batch + 1), key=lambda b, o=o: b / o.latency(b)),)
    return best


@pytest.mark.parametrize("solver", SOLVERS)
def test_random_instances_match_exhaustive_search(solver: str) -> None:
    rng = random.Random(2024)
    checked = with_slo = infeasible = 0
    while checked < 50:
        problem = random_problem(rng)
        expected = exhaustive(problem, documented_candidates(problem))
        try:
            solution = solve(problem, solver=solver)
        except PlanError:
            assert expected is None, f"a plan exists: {expected}; {problem}"
            infeasible += 1
            continue
        assert expected is not None
        assert solution.throughput == pytest.approx(expected[0], rel=1e-6), problem
        assert sum(solution.used.values()) == expected[1], problem
        if problem.slo_ms is None:  # the candidates lose nothing against every integer batch size
            assert solution.throughput == pytest.approx(exhaustive(problem, every_batch(problem))[0], rel=1e-6)
        else:
            assert solution.latency_ms <= problem.slo_ms * (1 + 1e-9)
            with_slo += 1
        checked += 1
    assert with_slo >= 10 and infeasible >= 5  # both kinds of instance were met


# -- infeasible problems -------------------------------------------------------------------------
def cpu_only(*names: str, units: int = 1) -> tuple[Option, ...]:
    return tuple(Option(name, "cpu", units, line(1, 1, 8), 8) for name in names)


@pytest.mark.parametrize(
    ("problem", "message"),
    [
        (
            Problem(cpu_only("a", "b", "c", "d"), dict.fromkeys("abcd", 1.0), {"cpu": 3, "gpu": 2}),
            "4 components need a cpu replica each (a, b, c, d) but cpu has 3 units; declare more with resources={'cpu': 4}",
        ),
        (
            Problem(cpu_only("a", "b", units=2), dict.fromkeys("ab", 1.0), {"cpu": 3}),
            "2 components need 4 cpu units for a replica each (a: 2, b: 2) but cpu has 3 units; "
            "declare more with resources={'cpu': 4}",
        ),
        (
            Problem(cpu_only("a"), {"a": 1.0, "b": 1.0}, {"cpu": 3}),
            "b has no option: it was profiled on no resource type",
        ),
        (
            Problem((Option("llm", "gpu", 2, line(10, 0, 8), 8),), {"llm": 1.0}, {"cpu": 4, "gpu": 1}),
            "llm cannot get one replica: it runs on gpu (2 units a replica, 1 there are); declare more with resources={'gpu': 2}",
        ),
        (
            Problem(cpu_only("a", "b"), {"a": 1.0, "b": 2.0}, {"cpu": 4}, slo_ms=10.0),
            "no batch size meets slo_ms=10: a request takes at least 12 ms even with every component at its fastest batch "
            "(a: 1 x 2 x 2 ms at batch 1 on cpu, b: 2 x 2 x 2 ms at batch 1 on cpu)",
        ),
    ],
)
def test_an_impossible_plan_says_what_is_missing(problem: Problem, message: str) -> None:
    with pytest.raises(PlanError) as raised:
        solve(problem, solver="highs")
    assert str(raised.value).startswith(message)


@pytest.mark.parametrize("solver", SOLVERS)
def test_components_competing_for_two_resource_types_are_reported_after_solving(solver: str) -> None:
    either = tuple(Option(name, kind, 1, line(1, 1, 8), 8) for name in "abc" for kind in ("cpu", "gpu"))
    problem = Problem(either, dict.fromkeys("abc", 1.0), {"cpu": 1, "gpu": 1})
    with pytest.raises(PlanError, match=r"no placement gives each of the 3 components a replica: one replica takes "
                       r"a: 1 cpu or 1 gpu; .*resources=\{'cpu': 1, 'gpu': 1\} are declared"):
        solve(problem, solver=solver)


def test_bad_problems_are_refused_when_built() -> None:
    with pytest.raises(ValueError, match="visits of a must be a finite number > 0; got 0"):
        Problem(cpu_only("a"), {"a": 0}, {"cpu": 1})
    with pytest.raises(ValueError, match="a has two options on cpu"):
        Problem(cpu_only("a", "a"), {"a": 1.0}, {"cpu": 1})
    with pytest.raises(ValueError, match="an option runs a, which has no visits entry"):
        Problem(cpu_only("a"), {"b": 1.0}, {"cpu": 1})
    with pytest.raises(ValueError, match="max_batch must be an int >= 1"):
        Option("a", "cpu", 1, line(1, 1, 8), 0)
    with pytest.raises(ValueError, match="solver must be one of 'auto', 'gurobi', 'highs'"):
        solve(Problem(cpu_only("a"), {"a": 1.0}, {"cpu": 1}), solver="cplex")


# -- solver choice -------------------------------------------------------------------------------
def large_problem() -> Problem:
    """130 components with 8 breakpoints each, under a loose SLO that keeps them all candidates: past
    2,000 variables and constraints, yet quick for HiGHS (one CPU each, so one replica each)."""
    rng = random.Random(5)
    xs = tuple(float(2**k) for k in range(8))
    options = []
    for i in range(130):
        intercept, slope = rng.uniform(1, 3), rng.uniform(0.02, 0.2)
        options.append(Option(f"c{i}", "cpu", 1, PiecewiseLinear(xs, tuple(intercept + slope * x for x in xs)), 128))
    return Problem(tuple(options), {f"c{i}": 1.0 for i in range(130)}, {"cpu": 130}, slo_ms=10_000.0)


@pytest.mark.skipif(not HAVE_GUROBI, reason="gurobipy is not installed")
def test_a_model_past_gurobis_pip_licence_solves_with_highs(caplog: pytest.LogCaptureFixture) -> None:
    problem = large_problem()
    with caplog.at_level(logging.INFO, logger="patchkit.scheduler.offline.milp"):
        solution = solve(problem)
    assert solution.solver == "highs"
    assert "size-limited license" in caplog.text and "solved with highs" in caplog.text
    # One CPU each; the slowest component at its largest batch, the one of most calls/s, sets the pace.
    assert {c.replicas for c in solution.choices.values()} == {1}
    slowest = min(problem.options, key=lambda o: 128 / o.latency(128))
    assert solution.bottleneck == slowest.component and solution.choices[slowest.component].batch_size == 128
    assert solution.throughput == pytest.approx(128_000 / slowest.latency(128))
    with pytest.raises(PlanError, match="solver='gurobi' cannot solve this plan: .*size-limited license"):
        solve(problem, solver="gurobi")


def test_auto_uses_gurobi_where_it_is_installed_and_highs_otherwise() -> None:
    assert solve(rag(line(0, 2, 64))).solver == ("gurobi" if HAVE_GUROBI else "highs")


# -- CPU in threads and shares of a core, from profiles ------------------------------------------
def profile(name: str, intercept: float, slope: float, top: int, threads: int = 1) -> ComponentProfile:
    points = tuple((b, intercept + slope * b) for b in (1, top))
    return ComponentProfile(name, "cpu", {"run": MethodProfile("run", points, top)}, {"run": 1.0}, threads)


LIGHT = ("retriever", "grader", "rewriter", "web")  # CRAG's components besides the LLM: quick, and they do not scale


def crag(slo_ms: float | None, cores: int, two: tuple[float, float] = (210, 52), light: tuple[str, ...] = LIGHT) -> Problem:
    """The LLM at 1 thread serves 8 calls in 1200 ms; at 2 threads T(b) = two[0] + two[1] b."""
    profiles = [profile("llm", 400, 100, 8), profile("llm", *two, 8, threads=2)]
    profiles += [profile(name, 2, 0.1, 64) for name in light]
    options = tuple(o for p in profiles for o in options_of(p))
    return Problem(options, dict.fromkeys(("llm", *light), 1.0), {"cpu": cores * SHARES_PER_CORE}, slo_ms,
                   per_declared={"cpu": SHARES_PER_CORE})


@pytest.mark.parametrize("solver", SOLVERS)
def test_replicas_of_several_cores_never_hold_more_cores_than_there_are(solver: str) -> None:
    # two engines that run only on 2 threads: lending half a core each they take 12 + 12 of 3 cores' 24 shares,
    # but 4 cores; on 4 they get 2 whole cores each
    options = tuple(o for name in ("a", "b") for o in options_of(profile(name, 210, 52, 8, threads=2)))

    def problem(cores: int) -> Problem:
        return Problem(options, {"a": 1.0, "b": 1.0}, {"cpu": cores * SHARES_PER_CORE}, per_declared={"cpu": SHARES_PER_CORE})

    with pytest.raises(PlanError):
        solve(problem(3), solver=solver)
    assert {(c.units, c.replicas) for c in solve(problem(4), solver=solver).choices.values()} == {(2 * SHARES_PER_CORE, 1)}


def test_a_profile_gives_whole_core_options_and_a_one_thread_profile_share_options_too() -> None:
    one, two = options_of(profile("llm", 400, 100, 8)), options_of(profile("llm", 210, 52, 8, threads=2))
    core = SHARES_PER_CORE
    assert [(o.units, o.threads) for o in one] == [(core, 1), (core - 1, 1), (core - 2, 1)] + [(s, 1) for s in SHARE_SIZES]
    assert [(o.units, o.threads) for o in two] == [(2 * core, 2), (2 * core - 1, 2), (2 * core - 2, 2), (2 * core - 4, 2)]
    assert lending_units(1) == [core - 1, core - 2] and lending_units(2) == [o.units for o in two[1:]]
    eighth = next(o for o in one if o.units == 1)
    assert eighth.latency(4) == pytest.approx(SHARES_PER_CORE * one[0].latency(4))  # an eighth of a busy core
    lending = two[-1]  # two cores but for the half it lends: 3/4 of their time
    assert lending.latency(4) == pytest.approx(two[0].latency(4) * 4 / 3)


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize(
    ("two", "llm_plan"),
    [
        # 2 threads: 8 calls in 540 ms, 14.8/s; lending half a core 11.1/s, against 10.0 below
        ((180, 45), (2 * SHARES_PER_CORE - 4, 2, 1)),
        # 2 threads: 8 in 626 ms, 12.8/s, lending half a core 9.6/s; 1 thread on each core, each lending
        # a quarter of it, 2 x 6.67 x 6/8 = 10.0/s
        ((210, 52), (SHARES_PER_CORE - 2, 1, 2)),
    ],
)
def test_five_components_share_two_cores_and_the_llm_computes_on_both(
    solver: str, two: tuple[float, float], llm_plan: tuple[int, int, int]
) -> None:
    solution = solve(crag(None, cores=2, two=two), solver=solver)
    llm = solution.choices["llm"]
    assert (llm.units, llm.threads, llm.replicas) == llm_plan
    assert {(solution.choices[n].units, solution.choices[n].replicas) for n in LIGHT} == {(1, 1)}
    assert solution.used == {"cpu": 2 * SHARES_PER_CORE} and solution.bottleneck == "llm"


@pytest.mark.parametrize("solver", SOLVERS)
def test_two_engines_lend_an_eighth_of_their_cores_to_one_light_component(solver: str) -> None:
    # an engine that gains little from a second thread (8 calls in 900 ms, 8.9/s; 8.3/s lending an
    # eighth) runs as two 1-thread replicas, a core each: 2 x 6.67 x 7/8 = 11.7/s, the retriever in a lent eighth
    solution = solve(crag(None, cores=2, two=(300, 75), light=("retriever",)), solver=solver)
    llm, retriever = solution.choices["llm"], solution.choices["retriever"]
    assert (llm.units, llm.threads, llm.replicas) == (SHARES_PER_CORE - 1, 1, 2)
    assert (retriever.units, retriever.replicas) == (1, 1)
    assert solution.throughput == pytest.approx(2 * 8000 / 1200 * 7 / 8, rel=1e-3)


@pytest.mark.parametrize("seed", range(12))
def test_every_plan_the_milp_gives_is_placed_without_oversubscription(seed: int) -> None:
    """Random pipelines of engines and light components on 1 to 3 cores: every replica of the plan is
    pinned (none floats for want of room), and no core is given more shares than it has."""
    rng = random.Random(seed)
    cores = rng.randint(1, 3)
    profiles = []
    for i in range(rng.randint(2, 5)):
        one = rng.uniform(50, 800)
        profiles.append(profile(f"c{i}", one, rng.uniform(0.05, 0.5) * one, 8))
        if rng.random() < 0.5:
            profiles.append(profile(f"c{i}", one * rng.uniform(0.5, 0.8), rng.uniform(0.05, 0.5) * one, 8, threads=2))
    names = sorted({p.component for p in profiles})
    options = tuple(o for p in profiles for o in options_of(p))
    problem = Problem(options, dict.fromkeys(names, 1.0), {"cpu": cores * SHARES_PER_CORE}, per_declared={"cpu": SHARES_PER_CORE})
    try:
        solution = solve(problem, solver="highs")
    except PlanError:
        assert len(names) > SHARES_PER_CORE * cores  # only too many components for the shares can fail
        return
    units = [c.units for c in solution.choices.values() for _ in range(c.replicas)]
    placed = assign([("cpu", u) for u in units], cpus=list(range(cores)), gpus=[])
    given = Counter()
    for u, r in zip(units, placed):
        assert r.cpus and len(r.cpus) == r.threads  # pinned, a thread a core
        given.update(dict.fromkeys(r.cpus, SHARES_PER_CORE) if u not in SHARE_SIZES else {r.cpus[0]: u})
        given[r.cpus[-1]] -= lent_shares(u)
    assert all(n <= SHARES_PER_CORE for n in given.values())


@pytest.mark.parametrize("solver", SOLVERS)
def test_an_llm_too_slow_for_the_slo_on_one_thread_gets_two(solver: str) -> None:
    # 2 x T(1) on one thread is 1000 ms, past the SLO; on two threads 524 ms (698 lending half a core)
    solution = solve(crag(800.0, cores=3), solver=solver)
    llm = solution.choices["llm"]
    assert (llm.units, llm.threads, llm.replicas) == (2 * SHARES_PER_CORE, 2, 1)
    assert all(solution.choices[n].units in SHARE_SIZES and solution.choices[n].threads == 1 for n in LIGHT)
    assert solution.latency_ms <= 800.0
    # on 2 cores, lending half a core to the light ones: 2 x 349 ms, and 4 x 2 x 16.8 ms on eighths of a core
    lent = solve(crag(900.0, cores=2), solver=solver).choices["llm"]
    assert (lent.units, lent.threads) == (2 * SHARES_PER_CORE - 4, 2)
    with pytest.raises(PlanError):
        solve(crag(800.0, cores=2), solver=solver)


@pytest.mark.parametrize("solver", SOLVERS)
def test_of_plans_as_fast_on_as_many_units_the_one_of_fewest_replicas_wins(solver: str) -> None:
    # one whole core or two halves: the same calls/s; a replica loads its own copy, so one is better
    a = Option("a", "cpu", 2, line(0, 2, 8), 8)
    problem = Problem((a, dataclasses.replace(a, units=4, latency=line(0, 1, 8))), {"a": 1.0}, {"cpu": 4})
    choice = solve(problem, solver=solver).choices["a"]
    assert (choice.units, choice.replicas) == (4, 1)


def test_a_component_that_needs_more_than_a_core_takes_whole_cores() -> None:
    # shares would divide 5 cores more finely (26 : 14 eighths), but replicas of one component would contend for them
    retriever, augmenter = profile("retriever", 0, 2, 64), profile("augmenter", 0, 1, 64)
    options = tuple(options_of(retriever) + options_of(augmenter))
    visits = {"retriever": 1.0, "augmenter": 1.0}
    problem = Problem(options, visits, {"cpu": 5 * SHARES_PER_CORE}, per_declared={"cpu": SHARES_PER_CORE})
    solution = solve(problem, solver="highs")
    assert {n: (c.units, c.replicas) for n, c in solution.choices.items()} == {
        "retriever": (SHARES_PER_CORE, 3), "augmenter": (SHARES_PER_CORE, 2)
    }
