"""`XGBoostEstimator`: the remaining time of a request in flight, predicted by a gradient-boosted
regressor on the Patchwork paper's features (query length, largest intermediate length, time in
components, time since arrival, fewest and most calls left on the graph, current node), retrained
from the finished traces it is given. It sees what a graph position cannot, such as a query whose
length makes every call slower. `deploy(estimator="xgboost")` chooses it.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from patchkit.capture.graph import Graph
from patchkit.capture.paths import CallsLeft
from patchkit.scheduler.online.averages import RunningAverage
from patchkit.scheduler.online.traces import Trace, finished_at, nodes_remaining, prefixes

__all__ = ["FEATURES", "XGBoostEstimator"]

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
    Needs the `xgboost` module (`pip install -e '.[sched]'` in patchkit's checkout, which brings `xgboost-cpu`).
    """

    name = "xgboost"

    def __init__(
        self,
        graph: Graph | CallsLeft | None = None,
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
        self._model: tuple[Any, CallsLeft, dict[str | None, int]] | None = None

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
            finished_at(trace)
        self._train(list(self.traces))

    def _train(self, traces: list[Trace]) -> None:
        if self.graph is None:
            left: CallsLeft = nodes_remaining(traces)
        elif isinstance(self.graph, Graph):
            left = nodes_remaining(self.graph)
        else:
            left = self.graph
        nodes = sorted({v.node for t in traces for v in t.visits})
        codes: dict[str | None, int] = {None: 0, **{node: i + 1 for i, node in enumerate(nodes)}}
        rows, labels = [], []
        for trace in traces:
            finished = finished_at(trace)
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


def _features(trace: Trace, k: int, now: float, left: CallsLeft, codes: Mapping[str | None, int]) -> list[float]:
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
        hint = "pip install -e '.[sched]' in patchkit's checkout"
        raise ImportError(f"XGBoostEstimator needs xgboost, which is not installed: {hint} ({exc})") from exc
    return xgboost
