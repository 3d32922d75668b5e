"""`Simulated`: a component that only takes time, for testing and benchmarking the planner.

A `Simulated` batch takes a known time as a function of its size, on the resource type it names,
and answers deterministically; the profiler, the MILP and the deployed front-end can then be
checked against latencies that are known in advance. It loads nothing and needs no library.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from patchkit.component import Component, make

__all__ = ["Simulated"]

RESOURCES = ("cpu", "gpu")
WORKS = ("sleep", "spin")
DEFAULT_MAX_BATCH = 64

LatencySpec = float | Callable[[int], float] | Sequence[tuple[float, float]]


class Simulated(Component):
    """A batch method `run(x)` that takes `latency_ms` per batch and answers from `output`.

    latency_ms: milliseconds per batch, whatever its size (a number); a function of the batch size
        `f(batch_size) -> ms`; or `(batch, ms)` points, linearly interpolated and flat beyond the ends.
    resource: the resource type a replica runs on, "cpu" or "gpu"; sets the instance's `devices`.
    max_batch: the largest batch one call takes (the memory bound `batch_limit` reports to deploy() and the profiler); a
        larger batch runs as consecutive batches of at most this size, as a component splitting its
        work to fit memory would.
    work: "sleep" waits out the batch time using no CPU, as a GPU kernel does; "spin" keeps a CPU busy
        for it, as CPU-bound code does.
    output: None answers each input unchanged; a callable answers `output(item)`; any other value is
        the answer to every item.

    The arguments travel to worker processes with cloudpickle, so a lambda works as `latency_ms` or
    `output`.
    """

    def __init__(
        self,
        latency_ms: LatencySpec,
        *,
        resource: str = "cpu",
        max_batch: int = DEFAULT_MAX_BATCH,
        work: str = "sleep",
        output: Any = None,
    ) -> None:
        if resource not in RESOURCES:
            raise ValueError(f"resource must be one of {', '.join(map(repr, RESOURCES))}; got {resource!r}")
        if work not in WORKS:
            raise ValueError(f"work must be one of {', '.join(map(repr, WORKS))}; got {work!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an int >= 1; got {max_batch!r}")
        self.latency_ms = latency_ms
        self.devices = (resource,)
        self.max_batch = max_batch
        self.work = work
        self.output = output
        self._latency = _latency_function(latency_ms)
        for size in (1, max_batch):  # a function is checked where the planner will evaluate it
            self.batch_ms(size)

    def batch_ms(self, size: int) -> float:
        """Milliseconds one batch of `size` calls takes (size <= max_batch); raises if latency_ms is invalid there."""
        ms = self._latency(size)
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
            raise ValueError(f"latency_ms({size}) must be a finite number of milliseconds >= 0; got {ms!r}")
        return float(ms)

    def batch_limit(self, method: str) -> int:
        """`max_batch`: what deploy() batches `run` up to by default and where the profiler starts."""
        super().batch_limit(method)  # a MakeError for a method that is not `run`
        return self.max_batch

    @make(batch=True, max_batch_size=DEFAULT_MAX_BATCH, read_only=True)
    def run(self, x: list[Any]) -> list[Any]:
        """Take the batch's time, then answer every item from `output`."""
        for start in range(0, len(x), self.max_batch):
            self._take(self.batch_ms(len(x[start : start + self.max_batch])) / 1000)
        if self.output is None:
            return list(x)
        if callable(self.output):
            return [self.output(item) for item in x]
        return [self.output] * len(x)

    def _take(self, seconds: float) -> None:
        if self.work == "sleep":
            time.sleep(seconds)
            return
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            pass


def _latency_function(latency_ms: LatencySpec) -> Callable[[int], float]:
    """The batch time as a function of batch size, from any of the forms `Simulated` takes."""
    if isinstance(latency_ms, bool):
        raise TypeError("latency_ms must be a number, a function of the batch size or (batch, ms) points; got a bool")
    if isinstance(latency_ms, (int, float)):
        if not math.isfinite(latency_ms) or latency_ms < 0:
            raise ValueError(f"latency_ms must be a finite number of milliseconds >= 0; got {latency_ms!r}")
        constant = float(latency_ms)
        return lambda size: constant
    if callable(latency_ms):
        return latency_ms
    if isinstance(latency_ms, (list, tuple)):
        return _interpolation(latency_ms)
    what = type(latency_ms).__name__
    raise TypeError(f"latency_ms must be a number, a function of the batch size or a list of (batch, ms) points; got {what}")


def _interpolation(points: Sequence[Any]) -> Callable[[int], float]:
    if not points:
        raise ValueError("latency_ms lists no (batch, ms) point")
    pairs: list[tuple[float, float]] = []
    for point in points:
        if not (isinstance(point, (list, tuple)) and len(point) == 2 and all(_is_number(v) for v in point)):
            raise TypeError(f"latency_ms points must be (batch, ms) pairs of numbers; got {point!r}")
        batch, ms = float(point[0]), float(point[1])
        if batch <= 0 or ms < 0:
            raise ValueError(f"latency_ms point {point!r}: the batch must be > 0 and the milliseconds >= 0")
        pairs.append((batch, ms))
    pairs.sort()
    batches = [b for b, _ in pairs]
    values = [ms for _, ms in pairs]
    for before, after in zip(batches, batches[1:]):
        if before == after:
            raise ValueError(f"latency_ms lists batch {before:g} twice")

    def interpolate(size: int) -> float:
        if size <= batches[0]:
            return values[0]
        if size >= batches[-1]:
            return values[-1]
        right = bisect.bisect_right(batches, size)
        x0, x1, y0, y1 = batches[right - 1], batches[right], values[right - 1], values[right]
        return y0 + (y1 - y0) * (size - x0) / (x1 - x0)

    return interpolate


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
