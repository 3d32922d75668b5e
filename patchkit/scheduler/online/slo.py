"""Online SLO policies (Patchwork section 3.4): which requests are at risk of missing their deadline,
least-slack-first in the component queues, and admission pausing.

The front-end keeps a `RequestState` per request: its deadline (the request's `slo_ms`, else the
endpoint's), and its `Trace` (the component calls it made, with their times). At every component
call, `SloPolicy.check` asks the estimator how long the request still needs: it is at risk when
`now + remaining > deadline`, as long as it can still be saved. Jumping the queues wins a request
back at most the queue waits still ahead of it (`WaitsAhead`, learned per position like the
estimator), so a request short by more than those, or already past its deadline, is lost:
favouring it would only make others late too. Its slack, `deadline - now - remaining`, orders the
at-risk calls ahead of the others in every queue (prioritisation). While any request in flight is at risk, new
requests wait in a bounded admission queue (admission pausing), each for no longer than it can
spare by its own estimate; when none is at risk, they are let in, in arrival order.
The third policy, autoscaling, decides on the same at-risk set (`autoscale.py`, applied from its own loop by
`patchkit.serving.scaling`) and counts its decisions here too. Each policy is switched by the deployment's
config and every decision is counted.
Requests without an SLO cost the policies nothing: they are neither traced nor learnt from.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from patchkit.errors import Overloaded
from patchkit.scheduler.online.averages import RunningAverage, WaitsAhead
from patchkit.scheduler.online.estimator import Estimator
from patchkit.scheduler.online.traces import Trace, Visit
from patchkit.scheduler.online.xgb import XGBoostEstimator

__all__ = ["RequestState", "SloPolicy", "make_estimator"]

logger = logging.getLogger(__name__)

TRACES_KEPT = 5000  # the last finished traces, for estimators trained offline and for accuracy reports


def make_estimator(name: str) -> Estimator:
    """The estimator a deployment's config names: "average" or "xgboost"."""
    return XGBoostEstimator() if name == "xgboost" else RunningAverage()


@dataclass(eq=False)
class RequestState:
    """One request in flight, as the policies see it."""

    id: str
    deadline: float | None  # on the policy's clock; None: no SLO applies
    trace: Trace
    at_risk: bool = False


class SloPolicy:
    """Called by the front-end: `admit` before a request starts, `check` at each of its component
    calls, `record` after each call, `finish` when it ends. Runs on the front-end's event loop."""

    def __init__(
        self,
        estimator: Estimator,
        *,
        prioritize: bool = True,
        pause_admission: bool = True,
        admission_limit: int = 1024,
        clock: Callable[[], float],
    ) -> None:
        self.estimator, self.clock = estimator, clock
        self.waits = WaitsAhead()
        self.prioritize, self.pause_admission, self.admission_limit = prioritize, pause_admission, admission_limit
        self.at_risk: set[RequestState] = set()
        # In flight and beyond saving (past their deadline, or short by more than the queue waits
        # ahead): not favoured, but a sign of overload.
        self.lost: set[RequestState] = set()
        self.waiting: deque[asyncio.Future[None]] = deque()
        self.finished: deque[Trace] = deque(maxlen=TRACES_KEPT)  # served by GET /v1/traces
        # at_risk, beyond_saving, prioritized_calls, admission_paused, admission_rejected, admission_timeouts;
        # scale_ups, scale_downs (the autoscaler's)
        self.counts: Counter[str] = Counter()

    # -- admission ------------------------------------------------------------------------------
    async def admit(self, state: RequestState | None = None) -> None:
        """Wait while admission is paused (a request in flight is at risk), for at most the time the
        new request can spare: its deadline less what the estimator expects it to take. A request
        with nothing to spare, or without an SLO, is not held back. Overloaded when the queue is full."""
        if not (self.pause_admission and (self.at_risk or self.waiting)):
            return
        spare = self._spare(state)
        if spare <= 0:
            return
        if len(self.waiting) >= self.admission_limit:
            self.counts["admission_rejected"] += 1
            raise Overloaded(len(self.waiting), self.admission_limit, "admission is paused while requests are at risk "
                             f"of missing their SLO and its queue is full ({len(self.waiting)} waiting); retry later")
        self.counts["admission_paused"] += 1
        turn = asyncio.get_running_loop().create_future()
        self.waiting.append(turn)
        try:
            await asyncio.wait_for(asyncio.shield(turn), spare)
        except TimeoutError:
            self.counts["admission_timeouts"] += 1  # it could wait no longer: in it goes
        finally:
            if turn in self.waiting:
                self.waiting.remove(turn)
                self._release()

    def _spare(self, state: RequestState | None) -> float:
        """Seconds a new request can wait and still meet its deadline, by the estimator."""
        if state is None or state.deadline is None:
            return 0.0
        now = self.clock()
        return state.deadline - now - self.estimator.remaining_s(state.trace, now)

    def _release(self) -> None:
        """Let waiting requests in, in arrival order, once no request in flight is at risk."""
        while self.waiting and not self.at_risk:
            turn = self.waiting.popleft()
            if not turn.done():
                turn.set_result(None)

    def pressed(self) -> int:
        """Requests in flight at risk or beyond saving; the autoscaler logs it with a scale-up."""
        return len(self.at_risk) + len(self.lost)

    def record_scaling(self, kind: str) -> None:
        """Called by the autoscaler for each decision it applied ("scale_up" or "scale_down"), so that
        stats and /metrics count it beside the other SLO decisions."""
        self.counts[kind + "s"] += 1

    def under_pressure(self) -> bool:
        """Read by the autoscaler: requests in flight are at risk of missing their SLO, or beyond saving."""
        return bool(self.at_risk or self.lost)

    # -- risk -----------------------------------------------------------------------------------
    def start(self, request_id: str, inputs: object, slo_ms: float | None, pipeline: str = "") -> RequestState:
        """Called when a request arrives, with its inputs, its SLO (None: the policies leave it alone) and the
        name of its pipeline, which its trace keeps."""
        now = self.clock()
        if slo_ms is None:
            return RequestState(request_id, None, Trace(request_id, now, 0, [], pipeline=pipeline))
        return RequestState(request_id, now + slo_ms / 1000, Trace(request_id, now, len(str(inputs)), [], pipeline=pipeline))

    def check(self, state: RequestState) -> float | None:
        """Called before each component call: the request's slack in seconds when it is at risk (the
        queues serve the least slack first), None when it is not or prioritisation is off."""
        if state.deadline is None:
            return None
        now = self.clock()
        slack = state.deadline - now - self.estimator.remaining_s(state.trace, now)
        savable = now < state.deadline and -slack <= self.waits.ahead_s(state.trace)
        at_risk = slack < 0 and savable
        if slack < 0 and not savable and state not in self.lost:
            self.counts["beyond_saving"] += 1
            self.lost.add(state)
        self._mark(state, at_risk)
        if at_risk and self.prioritize:
            self.counts["prioritized_calls"] += 1
            return slack
        return None

    def record(self, state: RequestState, visit: Visit) -> None:
        """Called after each component call returns."""
        state.trace.visits.append(visit)

    def finish(self, state: RequestState, *, ok: bool) -> None:
        """Called when the request ends; a request with an SLO that finished teaches the estimator."""
        if state.deadline is None:
            return
        state.trace.finished = self.clock()
        self.lost.discard(state)
        self._mark(state, False)
        if ok:
            self.estimator.observe(state.trace)
            self.waits.observe(state.trace)
            self.finished.append(state.trace)

    def _mark(self, state: RequestState, at_risk: bool) -> None:
        if at_risk and not state.at_risk:
            self.counts["at_risk"] += 1
            self.at_risk.add(state)
        elif not at_risk and state.at_risk:
            self.at_risk.discard(state)
        state.at_risk = at_risk
        if not self.at_risk:
            self._release()

    def stats(self) -> dict[str, int]:
        return {
            "at_risk_now": len(self.at_risk),
            "lost_now": len(self.lost),
            "admission_waiting": len(self.waiting),
            "at_risk_total": self.counts["at_risk"],
            "beyond_saving_total": self.counts["beyond_saving"],
            "prioritized_calls": self.counts["prioritized_calls"],
            "admission_paused": self.counts["admission_paused"],
            "admission_rejected": self.counts["admission_rejected"],
            "admission_timeouts": self.counts["admission_timeouts"],
            "scale_ups": self.counts["scale_ups"],
            "scale_downs": self.counts["scale_downs"],
        }
