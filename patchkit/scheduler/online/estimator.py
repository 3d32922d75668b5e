"""How long a request in flight still needs: the completion-time estimators of the SLO policies
(Patchwork section 3.4).

The front-end records each request as a `Trace`, the component calls it made so far (`Visit`s);
before each call, `SloPolicy.check` asks an estimator for the request's expected remaining seconds,
and when the request finishes, hands it the finished trace to learn from. Two estimators:

- `RunningAverage` (the default, as in the paper): per graph position, an exponentially weighted
  mean of the time from that position to the end. Cheap, and follows a drifting workload.
- `XGBoostEstimator`: a gradient-boosted regressor on the paper's features (query length, largest
  intermediate length, time in components, time since arrival, fewest and most calls left on the
  graph, current node), retrained from the finished traces it is given. It sees what a position
  cannot, such as a query whose length makes every call slower.

A trace's prefixes are the states the estimators are asked about: the request before each of its
calls, at the time the previous call returned (or the request arrived). The stretch after the last
call is not one, since `check` comes only before a call. `accuracy` scores an estimator on them.
Everything here is pure: no clock, no processes; times are whatever clock the traces were taken on.
"""

from __future__ import annotations

import heapq
import math
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from patchkit.capture.graph import OUTPUT, Graph

__all__ = [
    "Estimator",
    "NodesRemaining",
    "RunningAverage",
    "Trace",
    "Visit",
    "WaitsAhead",
    "XGBoostEstimator",
    "accuracy",
    "nodes_remaining",
    "prefixes",
]

NodesRemaining = Mapping[str | None, tuple[int, int]]
"""Per position (a node; None before the first call): the fewest and the most calls still to come."""

_START = "input:"  # the request's start, as a node of the successor maps below


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

    request_id: int
    arrived: float
    query_length: int  # a cheap size of the request's inputs
    visits: list[Visit] = field(default_factory=list)
    finished: float | None = None  # None while in flight

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
        return cls(data["request_id"], data["arrived"], data["query_length"], visits, data.get("finished"))


class Estimator(Protocol):
    """What the SLO policies need of an estimator; both run on the front-end's event loop."""

    name: str

    def remaining_s(self, trace: Trace, now: float) -> float:
        """Expected seconds until the request in flight completes, never negative."""
        ...

    def observe(self, trace: Trace) -> None:
        """Learn from a request that finished (its `finished` is set)."""
        ...


def prefixes(trace: Trace) -> Iterator[tuple[int, float]]:
    """The states a finished trace went through: (calls made, time it reached that state), one
    before each of its calls."""
    for k in range(len(trace.visits)):
        yield k, trace.visits[k - 1].finished if k else trace.arrived


def _finished(trace: Trace) -> float:
    if trace.finished is None:
        raise ValueError(f"request {trace.request_id} is still in flight: estimators learn from finished traces only")
    return trace.finished


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


# -- the running average ----------------------------------------------------------------------------
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
        self._next_calls = _next_calls(graph) if graph is not None else {}
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
        finished = _finished(trace)
        self._total.add(finished - trace.arrived)
        for k, reached in prefixes(trace):
            self._remaining.add(trace.visits[k - 1].node if k else None, finished - reached)

    def expected(self) -> dict[str | None, float]:
        """The learned expected remaining seconds per position, from the moment it is reached."""
        return {position: mean.value for position, mean in self._remaining.items()}

    def _borrowed(self, position: str | None) -> float | None:
        following = self._next_calls.get(_START if position is None else position, set()) - {OUTPUT}
        if not following:
            return None
        siblings = [
            mean.value
            for seen, mean in self._remaining.items()
            if following & self._next_calls.get(_START if seen is None else seen, set())
        ]
        return sum(siblings) / len(siblings) if siblings else None


# -- the queue waits ahead -----------------------------------------------------------------------------
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


# -- the graph's calls left ----------------------------------------------------------------------------
def nodes_remaining(source: Graph | Iterable[Trace]) -> dict[str | None, tuple[int, int]]:
    """Per position, the fewest and the most calls still to come on the way to an end of the graph.

    `source` is the pipeline's graph, or finished traces, whose successive calls then stand for its
    edges. An end is a node with no outgoing edge. Along a path each node counts once, and a loop is
    counted once: the most is the longest path over the loops collapsed to single steps, each
    step worth the calls it holds. Graph nodes are keyed by id and by their `component.method` label
    (a label on several nodes gets the fewest and the most of all of them).
    """
    successors, calls, labels = _successors(source)
    fewest = _fewest_calls(successors, calls)
    most = _most_calls(successors, calls)
    found: dict[str | None, tuple[int, int]] = {node: (fewest[node], most[node]) for node in calls}
    found[None] = (fewest[_START], most[_START])
    for label, ids in labels.items():
        if label not in found:
            found[label] = (min(fewest[i] for i in ids), max(most[i] for i in ids))
    return found


def _successors(source: Graph | Iterable[Trace]) -> tuple[dict[str, set[str]], set[str], dict[str, list[str]]]:
    """Successor sets over the call nodes, the request's start (`_START`) and `OUTPUT`."""
    successors: dict[str, set[str]] = {_START: set()}
    if isinstance(source, Graph):
        calls = {n for e in source.edges for n in (e.src, e.dst) if n != OUTPUT and not n.startswith(_START)}
        calls |= set(source.nodes)
        for edge in source.edges:
            if edge.src in calls and edge.dst != edge.src:
                successors.setdefault(edge.src, set()).add(edge.dst)
        successors[_START] = _first_calls(source, successors, calls)
        labels: dict[str, list[str]] = {}
        for node in source.nodes.values():
            labels.setdefault(node.label, []).append(node.id)
        return successors, calls, labels
    calls = set()
    for trace in source:
        path = [_START, *(v.node for v in trace.visits), OUTPUT]
        calls.update(path[1:-1])
        for src, dst in zip(path, path[1:]):
            if src != dst:
                successors.setdefault(src, set()).add(dst)
    return successors, calls, {}


def _first_calls(graph: Graph, successors: Mapping[str, set[str]], calls: set[str]) -> set[str]:
    """The calls a request can start with: each call that no other call feeds and, of each loop
    that no call outside it feeds, the calls an input feeds (all of the loop's, if none)."""
    among_calls = {src: after & calls for src, after in successors.items() if src in calls}
    first: set[str] = set()
    for component in _components(among_calls, calls):
        members = set(component)
        if any(after & members for src, after in among_calls.items() if src not in members):
            continue
        fed = {e.dst for e in graph.edges if e.src.startswith(_START) and e.dst in members}
        first |= fed if len(members) > 1 and fed else members
    return first


def _next_calls(graph: Graph) -> dict[str, set[str]]:
    """Per node id and label (and `_START`), the calls that can come right after it, or OUTPUT."""
    successors, _, labels = _successors(graph)
    following = {node: set(after) for node, after in successors.items()}
    for label, ids in labels.items():
        following.setdefault(label, set()).update(*(successors.get(i, set()) for i in ids))
    return following


def _fewest_calls(successors: Mapping[str, set[str]], calls: set[str]) -> dict[str, int]:
    """Shortest paths, in calls, to an end: Dijkstra from the ends backwards."""
    nodes = set(successors) | {n for after in successors.values() for n in after} | calls
    predecessors: dict[str, list[str]] = {n: [] for n in nodes}
    for src, after in successors.items():
        for dst in after:
            predecessors[dst].append(src)
    ends = [n for n in nodes if not successors.get(n)]
    # A loop with no way out (a `while True:` whose exit the graph misses) ends wherever it stops.
    ends += [n for component in _components(successors, nodes) if _closed(component, successors) for n in component]
    fewest = dict.fromkeys(nodes, math.inf)
    heap = [(0, n) for n in ends]
    for n in ends:
        fewest[n] = 0
    while heap:
        distance, node = heapq.heappop(heap)
        if distance > fewest[node]:
            continue
        step = distance + (node in calls)
        for src in predecessors[node]:
            if step < fewest[src]:
                fewest[src] = step
                heapq.heappush(heap, (step, src))
    return {n: int(d) for n, d in fewest.items()}


def _closed(component: list[str], successors: Mapping[str, set[str]]) -> bool:
    members = set(component)
    return len(component) > 1 and all(successors.get(n, set()) <= members for n in component)


def _most_calls(successors: Mapping[str, set[str]], calls: set[str]) -> dict[str, int]:
    """Longest paths, in calls, to an end, each loop (strongly connected component) one step worth
    its calls; the node's own call is not counted."""
    nodes = set(successors) | {n for after in successors.values() for n in after} | calls
    most: dict[str, int] = {}
    after_component: dict[int, int] = {}
    of: dict[str, int] = {}
    for index, component in enumerate(_components(successors, nodes)):  # ends first
        for node in component:
            of[node] = index
        worth = sum(node in calls for node in component)
        downstream = {of[dst] for node in component for dst in successors.get(node, ()) if of[dst] != index}
        after_component[index] = max((after_component[d] for d in downstream), default=0)
        for node in component:
            most[node] = worth - (node in calls) + after_component[index]
        after_component[index] += worth
    return most


def _components(successors: Mapping[str, set[str]], nodes: set[str]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively, in reverse topological order (a
    component comes after every component it leads to)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(successors.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            for dst in pending:
                if dst not in index:
                    index[dst] = low[dst] = len(index)
                    stack.append(dst)
                    on_stack.add(dst)
                    work.append((dst, iter(sorted(successors.get(dst, ())))))
                    break
                if dst in on_stack:
                    low[node] = min(low[node], index[dst])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(component)
    return found


# -- XGBoost ---------------------------------------------------------------------------------------------
FEATURES = (
    "query_length",
    "max_intermediate_length",
    "component_s",  # time in previous calls: the sum of their durations
    "elapsed_s",  # time since the request arrived
    "min_calls_left",
    "max_calls_left",
    "node",  # categorical
)


class XGBoostEstimator:
    """An XGBoost regressor of the remaining time on the paper's features (`FEATURES`).

    Trained from finished traces, every prefix an example labelled with the time from it to the
    end: `fit(traces)` trains at once; `observe` keeps the last `max_traces` and trains once it has
    `min_traces`, then again after every `retrain_every` more (on a thread of its own with
    `background`, the default: about 0.1 s on 500 traces, 0.35 s on 5,000, which the front-end's
    loop must not wait for; an estimate costs about 0.3 ms, against the running average's
    microsecond). Until trained, `remaining_s` is that of a
    `RunningAverage` fed the same traces. The fewest and most calls left come from `graph` (a
    `Graph` or `nodes_remaining`'s result), else from the successive calls of the traces trained on.
    Needs the `xgboost` module (`pip install 'patchkit[sched]'`, which brings `xgboost-cpu`).
    """

    name = "xgboost"

    def __init__(
        self,
        graph: Graph | NodesRemaining | None = None,
        *,
        min_traces: int = 50,
        retrain_every: int = 200,
        max_traces: int = 5000,
        rounds: int = 200,
        params: Mapping[str, Any] | None = None,
        alpha: float = 0.1,
        background: bool = True,
    ) -> None:
        if min_traces < 1 or retrain_every < 1:
            raise ValueError(f"min_traces ({min_traces}) and retrain_every ({retrain_every}) must be >= 1")
        if max_traces < min_traces:
            raise ValueError(f"max_traces ({max_traces}) must be >= min_traces ({min_traces})")
        self.xgboost = _import_xgboost()  # here, so that a deployment without it fails when configured
        self.min_traces, self.retrain_every, self.rounds = min_traces, retrain_every, rounds
        self.params = {
            "objective": "reg:squarederror",
            "eta": 0.05,
            "max_depth": 5,
            "min_child_weight": 5,
            "subsample": 0.8,
            "nthread": 1,  # it trains on the front-end's loop: leave the cores to the components
            "seed": 0,
            **(params or {}),
        }
        self.graph = graph
        self.fallback = RunningAverage(alpha, graph if isinstance(graph, Graph) else None)
        self.traces: deque[Trace] = deque(maxlen=max_traces)
        self.background = background
        self._since_training = 0
        self._training: threading.Thread | None = None
        # (booster, calls left per position, position codes): replaced whole, so a training thread
        # never leaves the front-end reading half of an old model and half of a new one.
        self._model: tuple[Any, NodesRemaining, dict[str | None, int]] | None = None

    @property
    def trained(self) -> bool:
        return self._model is not None

    def remaining_s(self, trace: Trace, now: float) -> float:
        """Called by `SloPolicy.check` before each of the request's calls."""
        model = self._model
        if model is None:
            return self.fallback.remaining_s(trace, now)
        booster, left, codes = model
        row = _features(trace, len(trace.visits), now, left, codes)
        predicted = booster.inplace_predict(_array([row]), validate_features=False)
        return max(0.0, float(predicted[0]))

    def observe(self, trace: Trace) -> None:
        """Called by `SloPolicy.finish` with each request that finished without error."""
        self.fallback.observe(trace)
        self.traces.append(trace)
        self._since_training += 1
        due = self._since_training >= self.retrain_every if self.trained else len(self.traces) >= self.min_traces
        if due and not (self._training is not None and self._training.is_alive()):
            self._since_training = 0
            if self.background:  # off the front-end's loop: training takes 0.1-0.35 s
                self._training = threading.Thread(target=self._train, args=(list(self.traces),), name="patchkit-xgboost")
                self._training.daemon = True
                self._training.start()
            else:
                self._train(list(self.traces))

    def fit(self, traces: Iterable[Trace]) -> None:
        """Train on logged finished traces (the last `max_traces` of them), replacing those kept."""
        self.traces.clear()
        self.traces.extend(traces)
        for trace in self.traces:
            _finished(trace)
        self._train(list(self.traces))

    def _train(self, traces: list[Trace]) -> None:
        if self.graph is None:
            left: NodesRemaining = nodes_remaining(traces)
        elif isinstance(self.graph, Graph):
            left = nodes_remaining(self.graph)
        else:
            left = self.graph
        nodes = sorted({v.node for t in traces for v in t.visits})
        codes: dict[str | None, int] = {None: 0, **{node: i + 1 for i, node in enumerate(nodes)}}
        rows, labels = [], []
        for trace in traces:
            finished = _finished(trace)
            for k, reached in prefixes(trace):
                rows.append(_features(trace, k, reached, left, codes))
                labels.append(finished - reached)
        if not rows:
            return  # no trace made a call: nothing to learn positions from yet
        data = self.xgboost.DMatrix(
            _array(rows), label=labels, feature_names=list(FEATURES), feature_types=["q"] * 6 + ["c"],
            enable_categorical=True, nthread=self.params["nthread"],
        )
        self._model = (self.xgboost.train(self.params, data, num_boost_round=self.rounds), left, codes)


def _features(trace: Trace, k: int, now: float, left: NodesRemaining, codes: Mapping[str | None, int]) -> list[float]:
    """The paper's features of `trace` after its first `k` calls, at time `now`; NaN where unknown."""
    visits = trace.visits[:k]
    position = visits[-1].node if visits else None
    fewest, most = left.get(position, (math.nan, math.nan))
    return [
        float(trace.query_length),
        float(max((max(v.input_length, v.output_length) for v in visits), default=0)),
        sum(v.finished - v.started for v in visits),
        now - trace.arrived,
        float(fewest),
        float(most),
        float(codes.get(position, math.nan)),
    ]


def _array(rows: list[list[float]]) -> Any:
    import numpy as np

    return np.asarray(rows, dtype=np.float32)


def _import_xgboost() -> Any:
    try:
        import xgboost
    except ImportError as exc:
        hint = "pip install 'patchkit[sched]'"
        raise ImportError(f"XGBoostEstimator needs xgboost, which is not installed: {hint} ({exc})") from exc
    return xgboost


# -- scoring ---------------------------------------------------------------------------------------------
def accuracy(estimator: Estimator, traces: Sequence[Trace], *, floor_s: float = 1e-3) -> dict[str, float]:
    """How well `estimator` predicts the remaining time of held-out finished `traces`, over every
    prefix: `mae_s` the mean absolute error, `bias_s` the mean signed error (below 0: it
    underestimates, so it flags too few requests), `mape` the mean absolute error relative to the
    true remaining time (a fraction) over prefixes with at least `floor_s` to go, and `prefixes`.
    Asks `remaining_s` only; it learns nothing from the traces."""
    errors, relative = [], []
    for trace in traces:
        finished = _finished(trace)
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
