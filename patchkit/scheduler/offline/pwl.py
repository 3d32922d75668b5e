"""`PiecewiseLinear`: a component's batch latency T(b) as a continuous piecewise-linear function.

The profiler measures milliseconds per batch at a few batch sizes and `PiecewiseLinear.fit` turns
them into the fewest segments that stay within a relative error; the MILP reads the breakpoints as
its candidate batch sizes, because along one linear segment the throughput b / T(b) is monotone, so
the best batch of a segment lies at one of its ends.

The fit is exact for the knots: among continuous piecewise-linear functions whose breakpoints are
measured batch sizes and whose values there are the measured ones, a dynamic program finds, for
each number of segments, the breakpoints with the smallest largest relative error. A least-squares
pass over the same breakpoints, reweighted towards the minimax fit, then replaces the values where
that lowers the error, so that one noisy measurement does not pin a segment.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["PiecewiseLinear"]


@dataclass(frozen=True)
class PiecewiseLinear:
    """Milliseconds per batch at ascending batch sizes, linear in between.

    Beyond the ends the end segments' slopes continue, never below 0 ms; a single breakpoint is a
    constant.
    """

    breakpoints: tuple[float, ...]
    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.breakpoints:
            raise ValueError("a PiecewiseLinear needs at least one breakpoint")
        if len(self.breakpoints) != len(self.values):
            raise ValueError(f"{len(self.breakpoints)} breakpoints but {len(self.values)} values; they must pair up")
        for x, y in zip(self.breakpoints, self.values):
            if not (math.isfinite(x) and math.isfinite(y)) or x <= 0 or y < 0:
                raise ValueError(f"breakpoint ({x}, {y}): batch sizes must be > 0 and milliseconds >= 0, both finite")
        for before, after in zip(self.breakpoints, self.breakpoints[1:]):
            if not before < after:
                raise ValueError(f"breakpoints must be strictly ascending; got {before} then {after}")

    @property
    def segments(self) -> int:
        """How many linear pieces lie between the breakpoints (a constant counts as one)."""
        return max(len(self.breakpoints) - 1, 1)

    def __call__(self, batch: float) -> float:
        """T(batch) in milliseconds."""
        xs, ys = self.breakpoints, self.values
        if len(xs) == 1:
            return ys[0]
        right = min(max(bisect.bisect_right(xs, batch), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[right - 1], xs[right], ys[right - 1], ys[right]
        return max(y0 + (y1 - y0) * (batch - x0) / (x1 - x0), 0.0)

    def scaled(self, factor: float) -> PiecewiseLinear:
        """T times `factor` (> 0): the curve of a replica that runs `factor` times slower (a share of a core)."""
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"factor must be a finite number > 0; got {factor!r}")
        return PiecewiseLinear(self.breakpoints, tuple(y * factor for y in self.values))

    def largest_within(self, limit_ms: float, low: int, high: int) -> int | None:
        """The largest integer batch in [low, high] whose T is at most `limit_ms`, or None.

        Called by the MILP to bound a batch size by the latency a request may spend on it.
        """
        if high < low:
            return None
        edges = sorted({float(low), float(high), *(x for x in self.breakpoints if low < x < high)})
        for left, right in reversed(list(zip(edges, edges[1:])) or [(float(low), float(high))]):
            start, end = math.ceil(left), math.floor(right)
            if start > end:
                continue
            t_start, t_end = self(start), self(end)
            if t_end <= limit_ms:
                return end
            if t_start > limit_ms:
                continue
            # T rises across this piece: it crosses the limit once, between start and end.
            batch = start + math.floor((limit_ms - t_start) / (t_end - t_start) * (end - start))
            batch = min(max(batch, start), end)
            while batch > start and self(batch) > limit_ms:  # rounding can overshoot by one
                batch -= 1
            while batch < end and self(batch + 1) <= limit_ms:
                batch += 1
            return batch
        return None

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]], *, tolerance: float = 0.05, max_segments: int = 4) -> PiecewiseLinear:
        """Fit (batch size, ms) measurements with the fewest segments within `tolerance`.

        Returns the fewest segments whose largest relative error at the points is at most
        `tolerance`, or, when none is, the most accurate with at most `max_segments`. Breakpoints are
        measured batch sizes; repeated batch sizes are averaged; one distinct batch size gives a
        constant. Called by the profiler once per component and resource type.
        """
        if tolerance < 0:
            raise ValueError(f"tolerance must be >= 0; got {tolerance}")
        if max_segments < 1:
            raise ValueError(f"max_segments must be >= 1; got {max_segments}")
        xs, ys = _averaged(points)
        if len(xs) == 1:
            return cls((float(xs[0]),), (float(ys[0]),))
        best: tuple[float, PiecewiseLinear] | None = None
        knots_by_count = _best_knots(xs, ys, min(max_segments, len(xs) - 1))
        for knots in knots_by_count:
            for candidate in (cls._on(xs, knots, ys[knots]), cls._on(xs, knots, _least_squares(xs, ys, knots))):
                error = _largest_relative_error(candidate, xs, ys)
                if best is None or error < best[0]:
                    best = (error, candidate)
            if best is not None and best[0] <= tolerance:
                break
        assert best is not None
        return best[1]

    @classmethod
    def _on(cls, xs: np.ndarray, knots: list[int], values: np.ndarray) -> PiecewiseLinear:
        return cls(tuple(float(xs[k]) for k in knots), tuple(max(float(v), 0.0) for v in values))


def _averaged(points: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Distinct batch sizes, ascending, each with the mean of its measurements."""
    if not points:
        raise ValueError("cannot fit a latency to no measurement")
    sums: dict[float, list[float]] = {}
    for point in points:
        if len(point) != 2:
            raise ValueError(f"each measurement is a (batch size, ms) pair; got {point!r}")
        batch, ms = float(point[0]), float(point[1])
        if not (math.isfinite(batch) and math.isfinite(ms)) or batch <= 0 or ms < 0:
            raise ValueError(f"measurement ({point[0]}, {point[1]}): the batch size must be > 0 and the ms >= 0, both finite")
        sums.setdefault(batch, []).append(ms)
    xs = np.array(sorted(sums))
    return xs, np.array([sum(sums[x]) / len(sums[x]) for x in xs])


def _relative_errors(fitted: np.ndarray, ys: np.ndarray) -> np.ndarray:
    # A measurement of 0 ms must be met exactly; any other is judged against its own size.
    return np.abs(fitted - ys) / np.maximum(ys, 1e-12)


def _largest_relative_error(pwl: PiecewiseLinear, xs: np.ndarray, ys: np.ndarray) -> float:
    return float(_relative_errors(np.array([pwl(x) for x in xs]), ys).max())


def _best_knots(xs: np.ndarray, ys: np.ndarray, max_segments: int) -> list[list[int]]:
    """For 1..max_segments segments, the knot indices (first and last point included) whose
    interpolant has the smallest largest relative error, by dynamic programming over the points."""
    n = len(xs)
    span = np.full((n, n), np.inf)  # span[i, j]: error of the straight line from point i to point j
    for i in range(n - 1):
        for j in range(i + 1, n):
            line = ys[i] + (ys[j] - ys[i]) * (xs[i : j + 1] - xs[i]) / (xs[j] - xs[i])
            span[i, j] = _relative_errors(line, ys[i : j + 1]).max()
    # error[s][j]: smallest error of s segments from point 0 to point j; previous[s][j]: the knot before j.
    error = np.full((max_segments + 1, n), np.inf)
    previous = np.zeros((max_segments + 1, n), dtype=int)
    error[0, 0] = 0.0
    for s in range(1, max_segments + 1):
        for j in range(1, n):
            candidates = np.maximum(error[s - 1, :j], span[:j, j])
            previous[s, j] = int(np.argmin(candidates))
            error[s, j] = candidates[previous[s, j]]
    found = []
    for s in range(1, max_segments + 1):
        knots, j = [n - 1], n - 1
        for level in range(s, 0, -1):
            j = int(previous[level, j])
            knots.append(j)
        found.append(knots[::-1])
    return found


def _least_squares(xs: np.ndarray, ys: np.ndarray, knots: list[int], rounds: int = 60) -> np.ndarray:
    """Values at the knots that bring the largest relative error of the continuous fit down.

    Least squares on relative errors, reweighted by Lawson's rule (each point's weight grows with its
    error), which tends to the minimax fit; the best round is kept.
    """
    knot_xs = xs[knots]
    basis = np.zeros((len(xs), len(knots)))  # hat functions: the fit is basis @ values
    for row, x in enumerate(xs):
        right = min(max(int(np.searchsorted(knot_xs, x, side="right")), 1), len(knots) - 1)
        weight = (x - knot_xs[right - 1]) / (knot_xs[right] - knot_xs[right - 1])
        basis[row, right - 1], basis[row, right] = 1 - weight, weight
    scale = 1 / np.maximum(ys, 1e-12)
    weights = np.full(len(xs), 1 / len(xs))
    best: tuple[float, np.ndarray] | None = None
    for _ in range(rounds):
        root = np.sqrt(weights) * scale
        values, *_ = np.linalg.lstsq(basis * root[:, None], ys * root, rcond=None)
        errors = _relative_errors(basis @ values, ys)
        if best is None or errors.max() < best[0]:
            best = (float(errors.max()), values)
        if errors.max() <= 1e-12:
            break
        weights = weights * errors
        weights /= weights.sum()
    assert best is not None
    return best[1]
