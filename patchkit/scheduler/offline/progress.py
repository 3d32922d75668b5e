"""What profiling shows while it runs: the step under way and the time left, and a line per profile done.

On a terminal the status line is rewritten in place; elsewhere (a log file, a notebook's captured
stderr) only the lines of finished profiles are printed. Time left is each remaining profile's
estimate (`Profiler` makes them from the calibration's call times), scaled by how the profiles done
so far compared with their own estimates.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["PRIOR_S", "Progress"]

PRIOR_S = 30.0  # seconds of profiles taken to have matched their estimates before any has finished


class Progress:
    """Profiling's status on stderr; one per `Profiler.run`. Called on the profiler's event loop only."""

    def __init__(self, *, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.estimates: dict[str, float] = {}  # profiles not finished: their estimated seconds
        self.finished = 0
        self.estimated_done = self.took_done = 0.0  # of the profiles finished that were measured
        self.current: tuple[str, float] | None = None  # the profile under way and when it began
        self.started = time.perf_counter()
        self._shown = False

    def expect(self, profile: str, seconds: float) -> None:
        """A profile to come, estimated to take `seconds` (0: read from the cache)."""
        self.estimates[profile] = max(seconds, 0.0)

    def begin(self, profile: str) -> None:
        self.current = (profile, time.perf_counter())
        self.note(profile)

    def note(self, what: str) -> None:
        """Show the step under way (a terminal only)."""
        if self.enabled and self.tty:
            total = self.finished + len(self.estimates)
            line = f"profiling [{self.finished}/{total}] {what} · {self.left()}"
            print(f"\r{line:<100.100}", end="", file=self.stream, flush=True)
            self._shown = True

    def done(self, profile: str, summary: str, *, measured: bool) -> None:
        """`profile` finished: print its line. `measured`: it ran (not read from the cache), so its time
        teaches the estimates of those left."""
        estimate = self.estimates.pop(profile, 0.0)
        took = time.perf_counter() - self.current[1] if self.current is not None and self.current[0] == profile else 0.0
        self.current = None
        self.finished += 1
        if measured and estimate > 0:
            self.estimated_done += estimate
            self.took_done += took
        if self.enabled:
            prefix = "\r" if self.tty and self._shown else ""
            total = self.finished + len(self.estimates)
            line = f"profiled [{self.finished}/{total}] {summary} " + (f"({took:.1f} s)" if measured else "(cached)")
            print(f"{prefix}{line:<100}", file=self.stream, flush=True)
            self._shown = False

    def seconds_left(self) -> float:
        """The estimate of the time left: the profiles to come and the rest of the one under way, scaled
        by how the finished ones compared with theirs (as if PRIOR_S more had matched theirs, so that one
        short profile does not swing it)."""
        scale = (self.took_done + PRIOR_S) / (self.estimated_done + PRIOR_S)
        left = sum(self.estimates.values()) * scale
        if self.current is not None and self.current[0] in self.estimates:
            ran = time.perf_counter() - self.current[1]
            left -= min(ran, self.estimates[self.current[0]] * scale)
        return max(left, 0.0)

    def left(self) -> str:
        seconds = self.seconds_left()
        return f"about {seconds:.0f} s left" if seconds >= 1 else "almost done"

    def close(self) -> None:
        if self.enabled and self.tty and self._shown:
            print(file=self.stream, flush=True)
        if self.enabled and self.finished:
            print(f"profiling took {time.perf_counter() - self.started:.1f} s", file=self.stream, flush=True)
