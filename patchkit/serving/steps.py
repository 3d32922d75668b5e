"""Step events: each component call of a request, reported as it starts and as it ends.

The request runner (runner.py) makes one `RequestSteps` per request. At each component call it
submits, `start` reports where in the graph the call is and what it calls; once the call's outcome
is in (the same done-callback that ends its span and records its `Visit` for the SLO estimators),
`end` reports the batch it rode in, the replica that ran it, its wait in the queue, its duration,
and a preview of its result (cut to `preview_chars`, 0 for none; none for a component whose class
sets `sensitive = True`) or its error. A request whose client asked for steps (`stream` with `steps`)
hands each event to its watcher, on the event loop, in the order the calls started and ended; every
request's calls are kept, without previews, in the front-end's `RecentRequests` for the dashboard's
timeline (`GET /v1/activity`).

Only the calls the request's own code makes through its call hook are steps: a holder's calls to a
component it was given, and a component made while the code runs (run in place, with no queue), are not.

An event is a JSON object:

    {"phase": "start", "call": 0, "node": "n1", "component": "retriever", "method": "retrieve", "at_ms": 0.4}
    {"phase": "end", "call": 0, "node": "n1", "component": "retriever", "method": "retrieve", "at_ms": 12.9,
     "batch": 4, "replica": "retriever#0", "wait_ms": 1.2, "duration_ms": 12.5, "preview": "['Exceptions ..."}

`call` numbers the request's calls from 0 in the order they were made; `at_ms` is milliseconds since
the request arrived; `duration_ms` runs from the call's submission to its outcome (its wait
included); `batch` and `replica` are null for a call that never left its queue. An end event carries
`"error": {"type", "message"}` instead of a preview when the call failed, and `"sensitive": true`
without a preview for a sensitive component.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_PREVIEW_CHARS", "CallStep", "RecentRequests", "RequestSteps", "preview_of"]

DEFAULT_PREVIEW_CHARS = 200
RECENT_REQUESTS = 50  # the requests the dashboard's timeline shows


def preview_of(value: Any, limit: int) -> str:
    """A short text of a call's result: a string as it is, anything else as its repr; cut to `limit`
    characters, an ellipsis marking the cut."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: max(limit - 1, 0)] + "\u2026"


@dataclass
class CallStep:
    """One component call of a request, as its step events and the dashboard's timeline show it."""

    call: int
    node: str | None
    component: str
    method: str
    sensitive: bool
    started_ms: float
    ended_ms: float | None = None
    batch: int | None = None
    replica: str | None = None
    wait_ms: float | None = None
    error: dict[str, str] | None = None

    def timing(self) -> dict[str, Any]:
        """Its timings and where it ran, never its data: what `GET /v1/activity` serves."""
        duration = None if self.ended_ms is None else self.ended_ms - self.started_ms
        return {"call": self.call, "node": self.node, "component": self.component, "method": self.method,
                "started_ms": round(self.started_ms, 3), "duration_ms": None if duration is None else round(duration, 3),
                "batch": self.batch, "replica": self.replica,
                "wait_ms": None if self.wait_ms is None else round(self.wait_ms, 3), "failed": self.error is not None}


@dataclass
class RequestSteps:
    """One request's calls, as they start and end. `watcher`: where its step events go (called on the event
    loop), when its client asked for them; `preview_chars`: how much of each result an end event shows."""

    request_id: str
    pipeline: str
    version: str
    watcher: Callable[[dict[str, Any]], object] | None = None
    preview_chars: int = DEFAULT_PREVIEW_CHARS
    arrived: float = field(default_factory=time.perf_counter)
    arrived_unix: float = field(default_factory=time.time)
    calls: list[CallStep] = field(default_factory=list)
    outcome: str | None = None
    latency_ms: float | None = None

    def _now_ms(self) -> float:
        return (time.perf_counter() - self.arrived) * 1000

    def start(self, node: str | None, component: str, method: str, *, sensitive: bool) -> CallStep:
        """A call was submitted; called by the runner in the request's greenlet, on the loop."""
        step = CallStep(len(self.calls), node, component, method, sensitive, self._now_ms())
        self.calls.append(step)
        if self.watcher is not None:
            self.watcher({"phase": "start", "call": step.call, "node": node, "component": component, "method": method,
                          "at_ms": round(step.started_ms, 3)})
        return step

    def end(self, step: CallStep, *, batch: int | None, replica: str | None, wait_s: float | None,
            result: Any = None, error: tuple[str, str] | None = None) -> None:
        """The call's outcome is in: `result`, or `error` as (type, message). Called from its future's done-callback."""
        step.ended_ms, step.batch, step.replica = self._now_ms(), batch, replica
        step.wait_ms = None if wait_s is None else wait_s * 1000
        if error is not None:
            step.error = {"type": error[0], "message": error[1]}
        if self.watcher is None:
            return
        timing = step.timing()
        event: dict[str, Any] = {"phase": "end", "call": step.call, "node": step.node, "component": step.component,
                                 "method": step.method, "at_ms": round(step.ended_ms, 3),
                                 **{key: timing[key] for key in ("batch", "replica", "wait_ms", "duration_ms")}}
        if step.error is not None:
            event["error"] = step.error
        elif step.sensitive:
            event["sensitive"] = True
        elif self.preview_chars:
            event["preview"] = preview_of(result, self.preview_chars)
        self.watcher(event)

    def finish(self, outcome: str, latency_s: float) -> None:
        """The request ended, with `outcome` (`outcome_of`)."""
        self.outcome, self.latency_ms = outcome, latency_s * 1000

    def timeline(self) -> dict[str, Any]:
        """The request and its calls' timings, as `GET /v1/activity` serves it."""
        return {"request_id": self.request_id, "pipeline": self.pipeline, "version": self.version,
                "arrived": self.arrived_unix, "outcome": self.outcome,
                "latency_ms": None if self.latency_ms is None else round(self.latency_ms, 3),
                "calls": [step.timing() for step in self.calls]}


class RecentRequests:
    """The last `size` requests that ended, their calls' timings; kept by the front-end for the dashboard."""

    def __init__(self, size: int = RECENT_REQUESTS) -> None:
        self._ended: deque[RequestSteps] = deque(maxlen=size)

    def add(self, steps: RequestSteps) -> None:
        """A request ended (called by the runner once, whatever its outcome)."""
        self._ended.append(steps)

    def timelines(self) -> list[dict[str, Any]]:
        """The newest first."""
        return [steps.timeline() for steps in reversed(self._ended)]
