"""The running-average estimators of the SLO policies (Patchwork section 3.4): per graph position,
an exponentially weighted mean of the time left (`RunningAverage`, the default estimator) and of the
queue waits still ahead (`WaitsAhead`). Cheap, and they follow a drifting workload.
"""

from __future__ import annotations

import math

from patchkit.capture.graph import OUTPUT, Graph
from patchkit.capture.paths import START, next_calls
from patchkit.scheduler.online.traces import Trace, finished_at, prefixes

__all__ = ["RunningAverage", "WaitsAhead"]


class _Mean:
    """An exponentially weighted mean whose first 1/alpha samples are averaged evenly, so that it
    does not lean on the first sample while it has few."""

    __slots__ = ("alpha", "count", "value")

    def __init__(self, alpha: float) -> None:
        self.alpha, self.count, self.value = alpha, 0, 0.0

    def add(self, sample: float) -> None:
        self.count += 1
        self.value += max(self.alpha, 1 / self.count) * (sample - self.value)


class _MeanPerPosition(dict[str | None, _Mean]):
    """A `_Mean` per graph position (None: before the first call), made as positions are seen."""

    def __init__(self, alpha: float) -> None:
        super().__init__()
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1]; got {alpha}")
        self.alpha = alpha

    def add(self, position: str | None, sample: float) -> None:
        mean = self.get(position)
        if mean is None:
            mean = self[position] = _Mean(self.alpha)
        mean.add(sample)


class RunningAverage:
    """Expected remaining time per graph position, the position being the last node visited (None
    before the first call).

    For each position, an exponentially weighted mean (weight `alpha`) of the time from reaching it
    to finishing, over the prefixes of the finished traces it observed; a request that has been at
    its position for a while has that much less to go. A position not seen yet borrows, when the
    pipeline's `graph` is given, the mean of the seen positions that share a next call with it (what
    follows that call is the same); otherwise it falls back to the mean total latency less the time
    since arrival; before any trace at all, to 0.
    """

    name = "average"

    def __init__(self, alpha: float = 0.1, graph: Graph | None = None) -> None:
        self._remaining = _MeanPerPosition(alpha)
        self.alpha = alpha
        self.graph = graph
        self._next_calls = next_calls(graph) if graph is not None else {}
        self._total = _Mean(alpha)

    def remaining_s(self, trace: Trace, now: float) -> float:
        """Called by `SloPolicy.check` before each of the request's calls."""
        position = trace.position
        mean = self._remaining.get(position)
        expected = mean.value if mean is not None else self._borrowed(position)
        if expected is not None:
            return max(0.0, expected - (now - trace.reached))
        if self._total.count:
            return max(0.0, self._total.value - (now - trace.arrived))
        return 0.0

    def observe(self, trace: Trace) -> None:
        """Called by `SloPolicy.finish` with each request that finished without error."""
        finished = finished_at(trace)
        self._total.add(finished - trace.arrived)
        for k, reached in prefixes(trace):
            self._remaining.add(trace.visits[k - 1].node if k else None, finished - reached)

    def expected(self) -> dict[str | None, float]:
        """The learned expected remaining seconds per position, from the moment it is reached."""
        return {position: mean.value for position, mean in self._remaining.items()}

    def _borrowed(self, position: str | None) -> float | None:
        following = self._next_calls.get(START if position is None else position, set()) - {OUTPUT}
        if not following:
            return None
        siblings = [
            mean.value
            for seen, mean in self._remaining.items()
            if following & self._next_calls.get(START if seen is None else seen, set())
        ]
        return sum(siblings) / len(siblings) if siblings else None


class WaitsAhead:
    """Per graph position, the queue waits a request still meets on its way to the end: an
    exponentially weighted mean over the finished traces, as `RunningAverage` learns the time left.

    Jumping the queues wins a request back at most these waits, so `SloPolicy` reads them to tell a
    request it can still save from one short by more than that. Unknown (infinite) at a position no
    finished trace has passed through yet.
    """

    def __init__(self, alpha: float = 0.1) -> None:
        self._ahead = _MeanPerPosition(alpha)

    def ahead_s(self, trace: Trace) -> float:
        """Called by `SloPolicy.check` before each of the request's calls."""
        mean = self._ahead.get(trace.position)
        return mean.value if mean is not None else math.inf

    def observe(self, trace: Trace) -> None:
        """Called by `SloPolicy.finish` with each request that finished without error."""
        ahead = 0.0
        for k in range(len(trace.visits) - 1, -1, -1):
            ahead += trace.visits[k].waited
            self._ahead.add(trace.visits[k - 1].node if k else None, ahead)
