"""Step events: each component call of a request, reported as it starts and as it ends.

The request runner (runner.py) makes one `RequestSteps` per request. At each component call it
submits, `start` reports where in the graph the call is and what it calls; once the call's outcome
is in (the same done-callback that ends its span and records its `Visit` for the SLO estimators),
`end` reports the batch it rode in, the replica that ran it, its wait in the queue, its duration,
and its error, or, where the deployment offers previews (its `steps` option is "previews"), a preview
of its result (`preview_of`; never of a component whose class sets `sensitive = True`). A request whose
client asked for steps (`stream` with `steps`) hands each event to its watcher, on the event loop, in the
order the calls started and ended; every request's calls are kept, without previews, in the front-end's
`RecentRequests` for the dashboard's timeline (`GET /v1/activity`).

Only the calls the request's own code makes through its call hook are steps: a holder's calls to a
component it was given, and a component made while the code runs (run in place, with no queue), are not.

An event is a `StepEvent`, JSON data:

    {"phase": "start", "call": 0, "node": "n1", "component": "retriever", "method": "retrieve", "at_ms": 0.4}
    {"phase": "end", "call": 0, "node": "n1", "component": "retriever", "method": "retrieve", "at_ms": 12.9,
     "batch": 4, "replica": "retriever#0", "wait_ms": 1.2, "duration_ms": 12.5,
     "preview": ["Exceptions are raised ...", "the tutorial"], "preview_truncated": true}

`call` numbers the request's calls from 0 in the order they were made; `at_ms` is milliseconds since
the request arrived; `duration_ms` runs from the call's submission to its outcome (its wait
included); `batch` and `replica` are null for a call that never left its queue. An end event carries
`"error": {"type", "message"}` when the call failed, `"sensitive": true` for a sensitive component, and
otherwise, with previews on, `preview` (its result as a JSON value, cut by structure) and
`preview_truncated` (whether anything was cut).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired

from typing_extensions import TypedDict

from patchkit.core.jsonable import NOT_JSON, json_form

__all__ = ["DEFAULT_PREVIEW_CHARS", "CallStep", "PreviewLimits", "RecentRequests", "RequestSteps", "StepError",
           "StepEvent", "preview_of"]

DEFAULT_PREVIEW_CHARS = 200
RECENT_REQUESTS = 50  # the requests the dashboard's timeline shows
_NON_FINITE = {math.inf: "Infinity", -math.inf: "-Infinity"}


class StepError(TypedDict):
    """A failed call's error: its type's name and its message."""

    type: str
    message: str


class StepEvent(TypedDict):
    """One step event: a component call of a request started or ended (the `step` of an `event: step`)."""

    phase: Literal["start", "end"]
    call: int
    """The request's calls numbered from 0 in the order they were made; a start and its end share it."""
    node: str | None
    """The call's node in the pipeline's graph, null for a call made outside the captured code."""
    component: str
    method: str
    at_ms: float
    """Milliseconds since the request arrived."""
    batch: NotRequired[int | None]
    """On an end: how many calls its batch held (null: it never left its queue)."""
    replica: NotRequired[str | None]
    wait_ms: NotRequired[float | None]
    duration_ms: NotRequired[float | None]
    error: NotRequired[StepError]
    sensitive: NotRequired[bool]
    """True, and no preview, for a component whose class sets `sensitive = True`."""
    preview: NotRequired[Any]
    """Where the deployment offers previews: the call's result as a JSON value, cut by structure."""
    preview_truncated: NotRequired[bool]
    """Whether the preview was cut (a string, a list, an object's keys, or nesting past the limits)."""


@dataclass(frozen=True)
class PreviewLimits:
    """How much of a result a preview shows: `chars` characters of text across its strings (each key cut to as
    many), `items` items of each list, `keys` entries of each object, containers nested `depth` deep (deeper ones
    shown empty)."""

    chars: int = DEFAULT_PREVIEW_CHARS
    items: int = 10
    keys: int = 10
    depth: int = 3


def preview_of(value: Any, limits: PreviewLimits = PreviewLimits()) -> tuple[Any, bool]:
    """A call's result as a JSON value within `limits`, and whether anything was cut.

    Values JSON cannot carry are converted as replies convert them (`core/jsonable.py`); one with no JSON form is
    shown as its type's name in angle brackets (`"<bytes>"`), a non-finite float as "NaN", "Infinity" or
    "-Infinity". Never a `repr`: a preview shows no more of an object than its data.
    """
    return _Preview(limits).show(value, 0)


class _Preview:
    """One preview being made: the text budget left, and whether anything was cut."""

    def __init__(self, limits: PreviewLimits) -> None:
        self.limits, self.chars, self.cut = limits, limits.chars, False

    def show(self, value: Any, depth: int) -> tuple[Any, bool]:
        return self._value(value, depth), self.cut

    def _value(self, value: Any, depth: int) -> Any:
        if getattr(value, "ndim", 0) and hasattr(value, "tolist"):  # an array: only the rows a preview can show
            self.cut |= len(value) > self.limits.items
            value = value[: self.limits.items]
        converted = json_form(value)
        if converted is NOT_JSON:
            return f"<{type(value).__name__}>"
        if isinstance(converted, str):
            return self._text(converted)
        if isinstance(converted, float) and not math.isfinite(converted):
            return _NON_FINITE.get(converted, "NaN")
        if isinstance(converted, (list, tuple)):
            return self._items(converted, depth)
        if isinstance(converted, dict):
            return self._entries(converted, depth)
        return converted

    def _text(self, text: str) -> str:
        shown = text[: max(self.chars, 0)]
        self.chars -= len(shown)
        self.cut |= len(shown) < len(text)
        return str(shown)

    def _items(self, items: list[Any] | tuple[Any, ...], depth: int) -> list[Any]:
        if depth >= self.limits.depth:
            self.cut |= bool(items)
            return []
        self.cut |= len(items) > self.limits.items
        return [self._value(item, depth + 1) for item in items[: self.limits.items]]

    def _entries(self, entries: dict[Any, Any], depth: int) -> dict[str, Any]:
        if depth >= self.limits.depth:
            self.cut |= bool(entries)
            return {}
        self.cut |= len(entries) > self.limits.keys
        shown: dict[str, Any] = {}
        for key, item in list(entries.items())[: self.limits.keys]:
            name = _key(key)  # a key's text is its own (cut to `chars`), not the budget's
            self.cut |= len(name) > self.limits.chars
            shown[name[: self.limits.chars]] = self._value(item, depth + 1)
        return shown


def _key(key: Any) -> str:
    """An object key as JSON writes it: a string as it is, a number, true, false or null as its JSON text."""
    if isinstance(key, str):
        return key
    if isinstance(key, bool) or key is None:
        return {True: "true", False: "false", None: "null"}[key]
    if isinstance(key, (int, float)):
        return str(key)
    return f"<{type(key).__name__}>"


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
    loop), when its client asked for them; `previews`: whether an end event shows a preview of the call's result
    (the deployment's steps option is "previews"), within `limits`."""

    request_id: str
    pipeline: str
    version: str
    watcher: Callable[[StepEvent], object] | None = None
    previews: bool = False
    limits: PreviewLimits = field(default_factory=PreviewLimits)
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
            self.watcher(StepEvent(phase="start", call=step.call, node=node, component=component, method=method,
                                   at_ms=round(step.started_ms, 3)))
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
        event = StepEvent(phase="end", call=step.call, node=step.node, component=step.component, method=step.method,
                          at_ms=round(step.ended_ms, 3), batch=step.batch, replica=step.replica,
                          wait_ms=timing["wait_ms"], duration_ms=timing["duration_ms"])
        if step.error is not None:
            event["error"] = StepError(type=step.error["type"], message=step.error["message"])
        elif step.sensitive:
            event["sensitive"] = True
        elif self.previews:
            event["preview"], event["preview_truncated"] = preview_of(result, self.limits)
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
