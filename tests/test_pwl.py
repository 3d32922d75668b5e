"""`PiecewiseLinear`: evaluation, the bound a latency limit puts on a batch, and the automatic fit."""

from __future__ import annotations

import math
import random

import pytest

from patchkit.scheduler.offline.pwl import PiecewiseLinear

SIZES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128)


def knee(b: float) -> float:
    """vLLM-like: a batch costs the same up to 32, then 0.5 ms per extra item."""
    return 10.0 if b <= 32 else 10.0 + 0.5 * (b - 32)


def largest_error(pwl: PiecewiseLinear, points: list[tuple[float, float]]) -> float:
    return max(abs(pwl(b) - ms) / ms for b, ms in points)


# -- evaluation --------------------------------------------------------------------------------------
def test_it_interpolates_and_extends_the_end_slopes_never_below_zero() -> None:
    pwl = PiecewiseLinear((2.0, 4.0, 8.0), (3.0, 5.0, 5.0))
    assert pwl(2) == 3.0 and pwl(3) == 4.0 and pwl(6) == 5.0
    assert pwl(1) == 2.0  # the first segment's slope, continued
    assert pwl(100) == 5.0  # the last segment is flat
    falling = PiecewiseLinear((1.0, 2.0), (10.0, 5.0))
    assert falling(3) == 0.0 and falling(50) == 0.0  # continued, it would go negative
    assert PiecewiseLinear((8.0,), (5.0,))(1000) == 5.0


def test_breakpoints_must_ascend_pair_up_and_be_positive() -> None:
    with pytest.raises(ValueError, match="strictly ascending"):
        PiecewiseLinear((4.0, 2.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="2 breakpoints but 1 values"):
        PiecewiseLinear((1.0, 2.0), (1.0,))
    with pytest.raises(ValueError, match="batch sizes must be > 0"):
        PiecewiseLinear((0.0, 2.0), (1.0, 1.0))
    with pytest.raises(ValueError, match="at least one breakpoint"):
        PiecewiseLinear((), ())


def test_largest_within_is_the_largest_integer_batch_under_the_limit() -> None:
    pwl = PiecewiseLinear((1.0, 32.0, 128.0), (10.0, 10.0, 58.0))
    assert pwl.largest_within(20.0, 1, 128) == 52  # 10 + 0.5 (b - 32) <= 20
    assert pwl.largest_within(100.0, 1, 128) == 128
    assert pwl.largest_within(9.0, 1, 128) is None
    assert pwl.largest_within(20.0, 1, 40) == 40


def test_largest_within_agrees_with_trying_every_batch() -> None:
    rng = random.Random(7)
    for _ in range(200):
        xs = sorted(rng.sample(range(1, 60), rng.randint(1, 4)))
        pwl = PiecewiseLinear(tuple(map(float, xs)), tuple(rng.uniform(0.5, 30) for _ in xs))
        low, high = rng.randint(1, 5), rng.randint(1, 80)
        limit = rng.uniform(0, 35)
        fits = [b for b in range(low, high + 1) if pwl(b) <= limit]
        assert pwl.largest_within(limit, low, high) == (max(fits) if fits else None)


# -- the fit -----------------------------------------------------------------------------------------
def test_a_straight_line_fits_with_one_segment() -> None:
    pwl = PiecewiseLinear.fit([(b, 3 + 0.5 * b) for b in SIZES])
    assert pwl.segments == 1 and pwl.breakpoints == (1.0, 128.0)
    assert pwl(256) == pytest.approx(3 + 0.5 * 256)


def test_flat_then_linear_finds_the_knee() -> None:
    pwl = PiecewiseLinear.fit([(b, knee(b)) for b in SIZES])
    assert pwl.breakpoints == (1.0, 32.0, 128.0)
    assert pwl.values == pytest.approx((10.0, 10.0, 58.0))


@pytest.mark.parametrize("seed", range(20))
def test_noisy_measurements_stay_within_the_tolerance(seed: int) -> None:
    rng = random.Random(seed)
    points = [(b, knee(b) * rng.uniform(0.98, 1.02)) for b in SIZES for _ in range(2)]
    pwl = PiecewiseLinear.fit(points, tolerance=0.05)
    averaged = {b: sum(ms for x, ms in points if x == b) / 2 for b in SIZES}
    assert largest_error(pwl, list(averaged.items())) <= 0.05
    assert pwl.segments <= 2  # the noise does not buy extra segments


def test_the_fewest_segments_within_the_tolerance_win() -> None:
    convex = [(b, 10 + b + 0.05 * b * b) for b in range(1, 129, 4)]
    assert largest_error(PiecewiseLinear.fit(convex, max_segments=1), convex) > 0.3
    loose = PiecewiseLinear.fit(convex, tolerance=0.3)
    tight = PiecewiseLinear.fit(convex, tolerance=0.05)
    assert largest_error(loose, convex) <= 0.3 and largest_error(tight, convex) <= 0.05
    assert 1 < loose.segments < tight.segments <= 4


def test_past_max_segments_it_returns_the_best_it_has() -> None:
    convex = [(b, 1 + b * b) for b in range(1, 41)]
    pwl = PiecewiseLinear.fit(convex, tolerance=0.0, max_segments=3)
    assert pwl.segments == 3
    assert largest_error(pwl, convex) < largest_error(PiecewiseLinear.fit(convex, tolerance=0.0, max_segments=1), convex)


def test_one_batch_size_gives_a_constant() -> None:
    pwl = PiecewiseLinear.fit([(8, 5.0)])
    assert pwl.breakpoints == (8.0,) and pwl(1) == 5.0 and pwl(1000) == 5.0
    assert PiecewiseLinear.fit([(8, 4.0), (8, 6.0)]) == pwl


def test_unsorted_input_with_duplicates_is_sorted_and_averaged() -> None:
    shuffled = [(4, 6.0), (1, 3.0), (4, 8.0), (2, 4.0), (8, 11.0)]
    pwl = PiecewiseLinear.fit(shuffled, tolerance=0.0)
    assert pwl == PiecewiseLinear.fit([(1, 3.0), (2, 4.0), (4, 7.0), (8, 11.0)], tolerance=0.0)
    assert [pwl(b) for b in (1, 2, 4, 8)] == pytest.approx([3.0, 4.0, 7.0, 11.0])


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ([], "no measurement"),
        ([(0, 1.0), (2, 2.0)], "batch size must be > 0"),
        ([(-1, 1.0)], "batch size must be > 0"),
        ([(1, -1.0)], "ms >= 0"),
        ([(1, math.nan)], "finite"),
    ],
)
def test_bad_measurements_are_refused(points: list[tuple[float, float]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PiecewiseLinear.fit(points)
