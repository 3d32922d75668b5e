"""What the front-end records of each request, for the SLO estimators (Patchwork section 3.4).

A `Trace` is one request: the component calls it made so far (`Visit`s). A trace's prefixes are the
states the estimators are asked about: the request before each of its calls, at the time the
previous call returned (or the request arrived). The stretch after the last call is not one, since
`SloPolicy.check` comes only before a call. Everything here is pure: no clock, no processes; times
are whatever clock the traces were taken on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from patchkit.capture.graph import OUTPUT, Graph
from patchkit.capture.paths import START, CallsLeft, calls_left, successor_map

__all__ = ["Trace", "Visit", "finished_at", "nodes_remaining", "prefixes"]


@dataclass
class Visit:
    """One component call a request made, recorded by the front-end when the call returns."""

    node: str  # the call's graph node (its id, or its `component.method` label)
    component: str
    started: float  # seconds, on the front-end's clock
    finished: float
    input_length: int  # a cheap size of the call's first argument
    output_length: int  # and of its result
    waited: float = 0.0  # seconds of it spent in the component's queue, before its batch left


@dataclass
class Trace:
    """One request as the front-end records it: its calls so far, in the order they returned."""

    request_id: str
    arrived: float
    query_length: int  # a cheap size of the request's inputs
    visits: list[Visit] = field(default_factory=list)
    finished: float | None = None  # None while in flight
    pipeline: str = ""  # the name of the pipeline it ran

    @property
    def position(self) -> str | None:
        """The node of the last call that returned; None before the first."""
        return self.visits[-1].node if self.visits else None

    @property
    def reached(self) -> float:
        """When the request reached its position: its last call returned, or it arrived."""
        return self.visits[-1].finished if self.visits else self.arrived

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, as `GET /v1/traces` serves it: timings and sizes, never the request's data."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Trace:
        visits = [Visit(**visit) for visit in data["visits"]]
        return cls(data["request_id"], data["arrived"], data["query_length"], visits, data.get("finished"),
                   data.get("pipeline", ""))


def prefixes(trace: Trace) -> Iterator[tuple[int, float]]:
    """The states a finished trace went through: (calls made, time it reached that state), one
    before each of its calls."""
    for k in range(len(trace.visits)):
        yield k, trace.visits[k - 1].finished if k else trace.arrived


def finished_at(trace: Trace) -> float:
    if trace.finished is None:
        raise ValueError(f"request {trace.request_id} is still in flight: estimators learn from finished traces only")
    return trace.finished


def nodes_remaining(source: Graph | Iterable[Trace]) -> CallsLeft:
    """Per position, the fewest and the most calls still to come (`capture.paths.calls_left`).

    `source` is the pipeline's graph, or finished traces, whose successive calls then stand for its
    edges. Graph nodes are keyed by id and by their `component.method` label.
    """
    if isinstance(source, Graph):
        return calls_left(*successor_map(source))
    successors: dict[str, set[str]] = {START: set()}
    calls: set[str] = set()
    for trace in source:
        path = [START, *(v.node for v in trace.visits), OUTPUT]
        calls.update(path[1:-1])
        for src, dst in zip(path, path[1:]):
            if src != dst:
                successors.setdefault(src, set()).add(dst)
    return calls_left(successors, calls)
