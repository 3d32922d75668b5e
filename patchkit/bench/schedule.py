"""When an open-loop run's requests arrive: a `Schedule` of piecewise-constant rates and its Poisson
arrival times.

`run_bench` (patchkit/bench/load.py) builds one from `rate=` or `schedule=` and sends a request at
each of its `arrivals`; `BenchResult` (patchkit/bench/report.py) reads its steps to report each.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass

from patchkit.errors import PatchkitError


@dataclass(frozen=True)
class Schedule:
    """Piecewise-constant arrival rates: `steps` are (start_s, requests per second), the first at 0 s."""

    steps: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise PatchkitError("the schedule has no steps")
        if self.steps[0][0] != 0:
            raise PatchkitError(f"the schedule must start at 0 s; its first step starts at {self.steps[0][0]:g} s")
        for (before, _), (after, _) in itertools.pairwise(self.steps):
            if after <= before:
                raise PatchkitError(f"schedule steps must be in increasing time order; {after:g} s comes after {before:g} s")
        for start, rate in self.steps:
            if not rate > 0 or math.isinf(rate):
                raise PatchkitError(f"the rate must be > 0 requests/s; got {rate:g} (at {start:g} s)")

    @classmethod
    def constant(cls, rate: float) -> Schedule:
        return cls(((0.0, float(rate)),))

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """`"0:50,10:100,20:50"`: 50 requests/s from 0 s, 100 from 10 s, 50 again from 20 s."""
        steps = []
        for part in text.split(","):
            start, sep, rate = part.partition(":")
            try:
                if not sep:
                    raise ValueError
                steps.append((float(start), float(rate)))
            except ValueError:
                raise PatchkitError(f"--schedule takes seconds:rate steps such as 0:50,10:100; got {part.strip()!r}") from None
        return cls(tuple(steps))

    def check_fits(self, seconds: float) -> None:
        """Every step must start inside the run, or the schedule says something the run never does."""
        last = self.steps[-1][0]
        if last >= seconds:
            raise PatchkitError(f"the schedule's step at {last:g} s starts after the run ends (seconds={seconds:g})")

    def rate_at(self, t: float) -> float:
        return next(rate for start, rate in reversed(self.steps) if start <= t)

    def ends(self, seconds: float) -> list[float]:
        """The end of each step: the next step's start, and `seconds` for the last."""
        return [start for start, _ in self.steps[1:]] + [seconds]

    def arrivals(self, seconds: float, rng: random.Random) -> list[float]:
        """Arrival times in [0, seconds): exponential gaps at each step's rate. Gaps are memoryless, so
        starting afresh at each step boundary gives exactly a Poisson process of the scheduled rate."""
        times: list[float] = []
        for (start, rate), end in zip(self.steps, self.ends(seconds)):
            t = start + rng.expovariate(rate)
            while t < end:
                times.append(t)
                t += rng.expovariate(rate)
        return times

    def describe(self) -> str:
        if len(self.steps) == 1:
            return f"{self.steps[0][1]:g} req/s"
        return ", ".join(f"{rate:g} req/s from {start:g} s" for start, rate in self.steps)
