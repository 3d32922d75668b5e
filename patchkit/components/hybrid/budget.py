"""Sizing the device budget from a search SLO (VectorLiteRAG).

A batch's search time is set by its CPU part, and that by the query that finds the fewest of its
probed vectors resident: the tail of the per-query hit rate. `choose_share` ranks clusters by how
often calibration queries probe them, and for growing resident shares measures each query's hit
rate, fits a Beta distribution to them, takes the hit rate the worst query of a batch reaches with
the given confidence, and predicts the batch's CPU time with a latency model profiled on the real
index. The smallest share whose prediction meets the SLO wins.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["CpuLatencyModel", "SloChoice", "choose_share", "fit_beta", "hit_rates", "tail_hit_rate"]

Array = np.ndarray[Any, Any]
SHARES = tuple(i / 20 for i in range(21))  # 0%, 5%, ..., 100% of the index's bytes


@dataclass(frozen=True)
class CpuLatencyModel:
    """Milliseconds a CPU search of one batch takes: fixed + per_vector * vectors scanned in the batch."""

    fixed_ms: float
    per_vector_ms: float

    def predict(self, vectors: float) -> float:
        return self.fixed_ms + self.per_vector_ms * vectors

    @classmethod
    def fit(cls, samples: list[tuple[float, float]]) -> CpuLatencyModel:
        """Least squares over (vectors scanned, ms) samples; slope and intercept kept >= 0."""
        if len(samples) < 2:
            raise ValueError(f"a latency model needs at least 2 samples; got {len(samples)}")
        x = np.array([s[0] for s in samples], dtype=np.float64)
        y = np.array([s[1] for s in samples], dtype=np.float64)
        slope, intercept = np.polyfit(x, y, 1) if np.ptp(x) > 0 else (0.0, float(y.mean()))
        return cls(max(0.0, float(intercept)), max(0.0, float(slope)))

    @classmethod
    def profile(cls, search: Callable[[Array], object], probes: Array, sizes: Array, *, repeats: int = 3) -> CpuLatencyModel:
        """Time `search(assignment)` with 1/8, 1/4, 1/2 and all of each query's probes (the rest -1).

        Called by the retriever's setup when the budget comes from an SLO; `probes` are calibration
        queries' assignments, [B, nprobe].
        """
        samples = []
        nprobe = probes.shape[1]
        for keep in sorted({max(1, nprobe // 8), max(1, nprobe // 4), max(1, nprobe // 2), nprobe}):
            partial = probes.copy()
            partial[:, keep:] = -1
            scanned = float(sizes[partial[partial >= 0]].sum())
            best = min(_timed(search, partial) for _ in range(repeats))
            samples.append((scanned, best))
        return cls.fit(samples)


def _timed(search: Callable[[Array], object], probes: Array) -> float:
    start = time.perf_counter()
    search(probes)
    return 1000 * (time.perf_counter() - start)


def hit_rates(probes: Array, sizes: Array, resident: Array) -> Array:
    """Per query, the share of its probed vectors that are resident."""
    valid = probes >= 0
    weights = np.where(valid, sizes[np.where(valid, probes, 0)], 0).astype(np.float64)
    hits = np.where(valid, resident[np.where(valid, probes, 0)], False) * weights
    total = weights.sum(axis=1)
    return np.divide(hits.sum(axis=1), total, out=np.ones_like(total), where=total > 0)


def fit_beta(samples: Array) -> tuple[float, float]:
    """Beta(a, b) with the samples' mean and variance (method of moments), kept proper near 0 and 1."""
    x = np.clip(np.asarray(samples, dtype=np.float64), 1e-4, 1 - 1e-4)
    mean, var = float(x.mean()), float(x.var())
    var = min(max(var, 1e-6), mean * (1 - mean) * 0.999)
    common = mean * (1 - mean) / var - 1
    return mean * common, (1 - mean) * common


def tail_hit_rate(a: float, b: float, batch: int, *, confidence: float = 0.9, draws: int = 4000, seed: int = 0) -> float:
    """The hit rate h with P(every query of a batch of `batch` has hit rate >= h) = `confidence`."""
    rng = np.random.default_rng(seed)
    worst = rng.beta(a, b, size=(draws, batch)).min(axis=1)
    return float(np.quantile(worst, 1 - confidence))


@dataclass(frozen=True)
class SloChoice:
    """The resident share chosen for an SLO and why: the predicted batch search time at that share."""

    share: float
    budget_bytes: int
    predicted_ms: float
    tail_hit_rate: float
    meets_slo: bool


def choose_share(
    probes: Array, sizes: Array, row_bytes: int, model: CpuLatencyModel, *, slo_ms: float, batch: int, confidence: float = 0.9
) -> SloChoice:
    """The smallest share of the index (5% steps) whose predicted batch search time meets `slo_ms`.

    `probes`: calibration queries' assignments [Q, nprobe], which also rank the clusters (most
    probed first). When no share meets the SLO, the whole index, flagged `meets_slo=False`.
    """
    if slo_ms <= 0:
        raise ValueError(f"the search SLO must be > 0 ms; got {slo_ms}")
    counts = np.bincount(probes[probes >= 0], minlength=len(sizes))
    order = np.argsort(-counts, kind="stable")
    cumulative = np.cumsum(sizes[order])
    total = int(sizes.sum())
    per_query = float(sizes[probes[probes >= 0]].sum()) / max(1, len(probes))
    choice = None
    for share in SHARES:
        taken = int(np.searchsorted(cumulative, share * total, side="right"))
        resident = np.zeros(len(sizes), dtype=bool)
        resident[order[:taken]] = True
        rates = hit_rates(probes, sizes, resident)
        tail = 1.0 if rates.min() >= 1 else tail_hit_rate(*fit_beta(rates), batch, confidence=confidence)
        predicted = model.predict(batch * per_query * (1 - tail)) if tail < 1 else 0.0
        budget = int(cumulative[taken - 1]) * row_bytes if taken else 0
        choice = SloChoice(share, budget, predicted, tail, predicted <= slo_ms)
        if choice.meets_slo:
            return choice
    assert choice is not None
    return choice
