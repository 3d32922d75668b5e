"""The candidate batch sizes of the planner's MILP (`milp.py`), which picks one per component.

Along one linear segment of T, with T(b) = a + s b, the throughput b / (a + s b) is monotone in b
(rising when a > 0), so without an SLO the best batch of a segment is one of its ends: the
candidates are 1, the breakpoints (rounded both ways) and max_batch, all within [1, max_batch], and
the plan is optimal over every integer batch size. With an SLO the per-request latency is estimated
as visits_i * 2 T_i(b_i) summed over components (a call waits for the batch in progress, then runs
in the next); each option also gets the largest batch that meets the SLO when every other component
runs at its fastest, and candidates that cannot meet it are dropped. The plan is then optimal among
these candidates.

A candidate that another beats on both latency and calls/s is left out of the model (without an SLO
only the batch of most calls/s stays, the smallest where they tie): it could not serve a plan better.

`milp.solve` calls `candidate_batches` before it builds the model; `usable` and `fastest` serve it and
`feasibility.py`'s checks too.
"""

from __future__ import annotations

import math

from patchkit.scheduler.offline.problem import Option, Problem
from patchkit.scheduler.offline.pwl import PiecewiseLinear

__all__ = ["candidate_batches", "fastest", "usable"]


def candidate_batches(problem: Problem) -> dict[tuple[str, str, int], tuple[int, ...]]:
    """Candidate batch sizes of every usable option, by `Option.key`, ascending.

    An option is usable when its resource has units enough for one replica; with an SLO only batch
    sizes that can meet it remain, and an option left with none is dropped.
    """
    quickest = {name: fastest(problem, name)[0] for name in problem.visits}
    found = {}
    for option in usable(problem):
        latency, top = option.latency, option.max_batch
        sizes = _segment_ends(option)
        for size in sizes:
            if latency(size) <= 0:
                raise ValueError(
                    f"{option.component} on {option.resource}: T({size}) is {latency(size)} ms; a batch must take > 0 ms"
                )
        if problem.slo_ms is not None:
            visits = problem.visits[option.component]
            others = sum(problem.visits[name] * 2 * ms for name, ms in quickest.items() if name != option.component)
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


def usable(problem: Problem) -> list[Option]:
    """The options whose resource has units enough for one replica."""
    return [o for o in problem.options if problem.capacity.get(o.resource, 0) >= o.units]


def _segment_ends(option: Option) -> set[int]:
    """1, max_batch and the breakpoints rounded down and up, within [1, max_batch]: the integer batch
    sizes at the ends of T's linear pieces, where both the most calls/s and the least latency lie."""
    rounded = {f(x) for x in option.latency.breakpoints for f in (math.floor, math.ceil)}
    return {1, option.max_batch} | {min(max(b, 1), option.max_batch) for b in rounded}


def fastest(problem: Problem, component: str) -> tuple[float, int, str]:
    """(ms, batch, resource) of the component's quickest batch over its usable options."""
    best = (math.inf, 0, "")
    for option in usable(problem):
        if option.component == component:
            best = min(best, *((option.latency(b), b, option.resource) for b in _segment_ends(option)))
    return best
