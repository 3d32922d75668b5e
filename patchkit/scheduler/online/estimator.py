"""How long a request in flight still needs: the interface of the SLO policies' completion-time
estimators (Patchwork section 3.4), and how one is scored.

The front-end records each request as a `Trace` (`traces.py`); before each call, `SloPolicy.check`
asks an estimator for the request's expected remaining seconds, and when the request finishes, hands
it the finished trace to learn from. Two estimators implement it: `RunningAverage` (`averages.py`,
the default, as in the paper) and `XGBoostEstimator` (`xgb.py`). `accuracy` scores either on
held-out traces.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from patchkit.scheduler.online.traces import Trace, finished_at, prefixes

__all__ = ["Estimator", "accuracy"]


class Estimator(Protocol):
    """What the SLO policies need of an estimator; both run on the front-end's event loop."""

    name: str

    def remaining_s(self, trace: Trace, now: float) -> float:
        """Expected seconds until the request in flight completes, never negative."""
        ...

    def observe(self, trace: Trace) -> None:
        """Learn from a request that finished (its `finished` is set)."""
        ...


def accuracy(estimator: Estimator, traces: Sequence[Trace], *, floor_s: float = 1e-3) -> dict[str, float]:
    """How well `estimator` predicts the remaining time of held-out finished `traces`, over every
    prefix: `mae_s` the mean absolute error, `bias_s` the mean signed error (below 0: it
    underestimates, so it flags too few requests), `mape` the mean absolute error relative to the
    true remaining time (a fraction) over prefixes with at least `floor_s` to go, and `prefixes`.
    Asks `remaining_s` only; it learns nothing from the traces."""
    errors, relative = [], []
    for trace in traces:
        finished = finished_at(trace)
        for k, reached in prefixes(trace):
            state = Trace(trace.request_id, trace.arrived, trace.query_length, trace.visits[:k])
            truth = finished - reached
            error = estimator.remaining_s(state, reached) - truth
            errors.append(error)
            if truth >= floor_s:
                relative.append(abs(error) / truth)
    if not errors:
        raise ValueError("accuracy needs finished traces that made at least one call")
    return {
        "mae_s": sum(map(abs, errors)) / len(errors),
        "bias_s": sum(errors) / len(errors),
        "mape": sum(relative) / len(relative) if relative else math.nan,
        "prefixes": float(len(errors)),
    }
