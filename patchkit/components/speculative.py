"""`SpeculativeRetriever`: RaLMSpec's speculative retrieval for iterative pipelines.

An iterative pipeline (IRCoT, Iter-RetGen) retrieves again after every few generated tokens, and
consecutive retrievals of one request tend to find the same documents. The speculative retriever
keeps a per-request cache of the documents real retrievals found (their top `cache_topk`, a
prefetch) and answers the next retrievals from it, scored exactly as the base retriever scores
(for FAISS, a flat FAISS index of the cached vectors with the base's metric): whenever the base's
true top-k sits in the cache, the cache answers exactly that. Every `stride` speculative answers
are checked together in one base search (batched verification); the first mismatch comes back as
a rollback naming that retrieval, with its true documents, and the pipeline redoes its work from
there, so its outputs equal the plain retriever's. With `async_verify`, the check runs in the
background while the pipeline generates its next step, and the next call collects it.

The cache, the unverified speculations and the measurements live in a `SpeculativeState` that
the pipeline threads through its calls (`state = retriever.retrieve(state, query)`): a picklable
value that travels with the request, so any worker process or replica can serve the next call.
A background verification is the one thing a worker holds, keyed by a ticket in the state; when
the next call lands where the ticket is unknown (another replica, a restarted worker), that
replica runs the verification again: slower, never different.

Retrievals of one request are numbered in call order: `start` answers retrieval 0, and each
`retrieve` the next one. A pipeline that keeps what it did after retrieval `n` can roll back to
`n` (see `examples/speculative.py`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from patchkit.components.documents import Hit, fingerprint
from patchkit.components.retrievers import VectorRetriever, Vectors
from patchkit.components.stride import estimate_gamma, optimal_stride
from patchkit.core import Component, ensure_setup, make

__all__ = ["SpeculativeRetriever", "SpeculativeState"]

logger = logging.getLogger(__name__)

MAX_INFLIGHT_VERIFICATIONS = 4096  # tickets a worker keeps for requests that have not collected them
DECODE_SMOOTHING = 0.5  # weight of the newest latency sample: "the most recent steps" of RaLMSpec's estimates

Found = list[tuple[int, float]]  # (document index, score) pairs, best first, as VectorRetriever.search gives


def smoothed(mean: float | None, sample: float) -> float:
    return sample if mean is None else DECODE_SMOOTHING * sample + (1 - DECODE_SMOOTHING) * mean


@dataclass(frozen=True)
class Speculation:
    """One retrieval answered from the cache: its number, query vector and the document indexes it gave."""

    number: int
    query: Vectors
    ids: tuple[int, ...]


@dataclass(frozen=True)
class Verification:
    """The base's answers (top `cache_topk`) for a run of speculations, and how long the search took."""

    found: list[Found]
    seconds: float


@dataclass
class SpeculativeState:
    """A request's speculative retrieval state, returned by every `SpeculativeRetriever` call.

    What a pipeline reads:
    - `docs`: the answer to the latest retrieval (speculative until verified), best first;
    - `rollback`: None, or the number of the first retrieval whose earlier answer was wrong: redo
      everything done after that retrieval, with `docs`, its true answer;
    - `verified`: whether every answer so far is confirmed by the base (true after `settle`, unless
      it rolled back); `retrievals`, `stride`, `hits`, `misses`, `rollbacks`, `verifications`.
    The rest is the cache and the scheduler's measurements. It pickles, and travels with the request.
    """

    docs: list[Hit]
    corpus: str
    cache_ids: np.ndarray[Any, np.dtype[np.int64]]
    cache_vectors: Vectors
    retrievals: int = 1
    rollback: int | None = None
    stride: int = 1
    unverified: list[Speculation] = field(default_factory=list)
    pending: str | None = None  # ticket of a background verification of the oldest `pending_count` speculations
    pending_count: int = 0
    window: list[tuple[int, int]] = field(default_factory=list)  # (stride, matched) of recent verifications
    decode_s: float | None = None
    verify_s: float | None = None
    returned_at: float = 0.0
    hits: int = 0
    misses: int = 0
    rollbacks: int = 0
    verifications: int = 0

    @property
    def verified(self) -> bool:
        """Whether every speculation has been checked against the base retriever."""
        return not self.unverified and self.pending is None

    def copy(self) -> SpeculativeState:
        """A copy whose lists are its own: a call returns a new state, never changing the one it was given."""
        # Calls never mutate the state they are given: an eager pipeline may still hold it.
        return replace(self, docs=list(self.docs), unverified=list(self.unverified), window=list(self.window))


class SpeculativeRetriever(Component):
    """Speculative retrieval over a `VectorRetriever` (exact for FAISS flat), RaLMSpec style.

    Pipeline code: `state = retriever.start(question)`, then `state = retriever.retrieve(state, query)`
    for each further retrieval, reading `state.docs` and rolling back when `state.rollback` is set,
    and `state = retriever.settle(state)` before the output (it verifies what is left).

    Args:
        base: the retriever whose answers are speculated and verified.
        cache_topk: the documents each real retrieval adds to the cache.
        stride: the speculations per verification, an int or "auto" (the optimal stride scheduler:
            stride 1 for a request's first guess, then from its measurements, seeded with this replica's
            decode latency).
        async_verify: run each check in the background while the pipeline generates its next step; the
            next call collects it.
        max_stride: the largest stride (with "auto", the largest it picks).
        gamma_max: the speculation accuracy "auto" assumes with no evidence yet, and the cap of its
            estimate, in (0, 1).
        window: the recent verifications "auto" estimates the accuracy from.
        cache_limit: the most documents a request's cache holds (the newest kept).

    Raises:
        ValueError: a bound out of range.
    """

    in_place = ("base",)  # it reads the base's index and vectors: a private part, not a shared deployment

    def __init__(
        self,
        base: VectorRetriever,
        *,
        cache_topk: int = 20,
        stride: int | str = "auto",
        async_verify: bool = True,
        max_stride: int = 8,
        gamma_max: float = 0.6,
        window: int = 5,
        cache_limit: int = 1024,
    ) -> None:
        if not isinstance(base, VectorRetriever):
            raise TypeError(f"SpeculativeRetriever needs a VectorRetriever base, such as FaissRetriever(...); got {base!r}")
        if cache_topk < base.topk:
            raise ValueError(f"cache_topk ({cache_topk}) must be >= the base retriever's topk ({base.topk})")
        if max_stride < 1:
            raise ValueError(f"max_stride must be >= 1; got {max_stride}")
        if stride != "auto" and not (isinstance(stride, int) and 1 <= stride <= max_stride):
            raise ValueError(f"stride must be 'auto' or an int from 1 to max_stride ({max_stride}); got {stride!r}")
        if not 0.0 < gamma_max < 1.0:
            raise ValueError(f"gamma_max must be within (0, 1); got {gamma_max}")
        if window < 1:
            raise ValueError(f"window must be >= 1; got {window}")
        if cache_limit < cache_topk:
            raise ValueError(f"cache_limit ({cache_limit}) must be >= cache_topk ({cache_topk})")
        self.base, self.cache_topk, self.stride, self.async_verify = base, cache_topk, stride, async_verify
        self.max_stride, self.gamma_max, self.window, self.cache_limit = max_stride, gamma_max, window, cache_limit

    def setup(self) -> None:
        """Set up the base retriever and take its corpus and index."""
        ensure_setup(self.base)
        self.topk = self.base.topk
        self.corpus = f"{fingerprint(self.base.docs)}-{self.base.embedder.name}"
        index = getattr(self.base, "index", None)
        self._faiss_metric: int | None = getattr(index, "metric_type", None)
        self._all_vectors: Vectors | None = None
        if index is not None and hasattr(index, "nlist"):
            import faiss

            faiss.extract_index_ivf(index).make_direct_map()  # lets reconstruct_batch read IVF lists
        elif index is None:
            self._all_vectors = self.base._vectors()  # Chroma/Qdrant hold their vectors out of reach
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="patchkit-verify")
        self._inflight: OrderedDict[str, Future[Verification]] = OrderedDict()
        self._lock = threading.Lock()
        self.totals: Counter[str] = Counter()  # this process's counts over every request, for benchmarks and logs
        self.strides: Counter[int] = Counter()  # strides of the verifications run here
        # This replica's latest decode latency over all requests: a new request's estimate starts
        # from it, so its second stride need not wait for its own steps to be measured.
        self._decode_s: float | None = None

    # -- pipeline calls ------------------------------------------------------------------------------
    @make(batch=True, max_batch_size=64)
    def start(self, query: list[str]) -> list[SpeculativeState]:
        """Retrieval 0 of each request, from the base; its top `cache_topk` seed the request's cache."""
        verification = self._search(self.base.embedder.encode(list(query)))
        states = []
        for found in verification.found:
            ids = np.array([i for i, _ in found], dtype=np.int64)
            state = SpeculativeState(self._hits(found), self.corpus, np.empty(0, np.int64), np.empty((0, 0), np.float32))
            self._add_to_cache(state, ids)
            # "auto" starts at stride 1 (RaLMSpec): the first guess, made from the question's documents
            # alone, is the likeliest to miss, and a miss found late throws away every step since.
            state.stride = 1 if self.stride == "auto" else int(self.stride)
            state.decode_s, state.verify_s, state.returned_at = self._decode_s, verification.seconds, time.time()
            states.append(state)
        self._count(retrievals=len(query), base_queries=len(query))
        return states

    @make(batch=True, max_batch_size=64)
    def retrieve(self, state: list[SpeculativeState], query: list[str]) -> list[SpeculativeState]:
        """The next retrieval of each request, from its cache; verifies when a stride is full.

        When a background verification of this request's earlier answers found a mismatch, the
        query is not answered: the state comes back with `rollback` set and that retrieval's true docs.
        """
        states = [self._checked(s, "retrieve") for s in state]
        now = time.time()
        for s in states:
            s.rollback = None
            if s.returned_at:
                sample = max(0.0, now - s.returned_at)
                s.decode_s = smoothed(s.decode_s, sample)
                self._decode_s = smoothed(self._decode_s, sample)
        self._collect(states)
        live = [i for i, s in enumerate(states) if s.rollback is None]
        vectors = self.base.embedder.encode([query[i] for i in live]) if live else np.empty((0, 0), np.float32)
        full = []
        for i, vector in zip(live, vectors):
            s = states[i]
            ids, scores = self._speculate(s, vector)
            s.unverified.append(Speculation(s.retrievals, vector, ids))
            s.docs = self._hits(list(zip(ids, scores)))
            s.retrievals += 1
            if len(s.unverified) >= s.stride:
                full.append(s)
        if self.async_verify:
            for s in full:
                self._launch(s)
        else:
            self._verify(full, answered=[s.retrievals - 2 for s in full])
        self._count(retrievals=len(live))
        return [self._finish(s) for s in states]

    @make(batch=True, max_batch_size=64)
    def settle(self, state: list[SpeculativeState]) -> list[SpeculativeState]:
        """Verify every answer not yet verified; called before the pipeline's output depends on them.

        Afterwards `verified` is true and `docs` is the base's own answer to the latest retrieval,
        unless a mismatch set `rollback`: then redo from there and settle again.
        """
        states = [self._checked(s, "settle") for s in state]
        for s in states:
            s.rollback = None
        self._collect(states)
        open_ = [s for s in states if s.rollback is None and s.unverified]
        self._verify(open_, answered=[s.retrievals - 1 for s in open_])
        return [self._finish(s) for s in states]

    # -- verification ----------------------------------------------------------------------------------
    def _search(self, queries: Vectors) -> Verification:
        """One base search for a batch of query vectors: the batched verification."""
        started = time.perf_counter()
        found = self.base.search(np.ascontiguousarray(queries, dtype=np.float32), self.cache_topk) if len(queries) else []
        return Verification(found, time.perf_counter() - started)

    def _verify(self, states: list[SpeculativeState], answered: list[int]) -> None:
        """Verify each state's unverified speculations now, all of them in one base search."""
        if not states:
            return
        runs = [list(s.unverified) for s in states]
        verification = self._search(np.stack([spec.query for run in runs for spec in run]))
        at = 0
        for s, run, last in zip(states, runs, answered):
            found = verification.found[at : at + len(run)]
            at += len(run)
            self._apply(s, run, Verification(found, verification.seconds), answered=last)

    def _launch(self, state: SpeculativeState) -> None:
        """Start verifying `state`'s speculations in the background; the request's next call collects it."""
        run = list(state.unverified)
        ticket = uuid.uuid4().hex
        future = self._executor.submit(self._search, np.stack([spec.query for spec in run]))
        with self._lock:
            self._inflight[ticket] = future
            while len(self._inflight) > MAX_INFLIGHT_VERIFICATIONS:  # abandoned requests: forget their oldest
                self._inflight.popitem(last=False)[1].cancel()
        state.pending, state.pending_count = ticket, len(run)

    def _collect(self, states: list[SpeculativeState]) -> None:
        """Apply each state's background verification; run it here when this process does not hold it."""
        missing = []
        for s in states:
            if s.pending is None:
                continue
            with self._lock:
                future = self._inflight.pop(s.pending, None)
            run = s.unverified[: s.pending_count]
            s.pending, s.pending_count = None, 0
            if future is None or future.cancelled():
                missing.append((s, run))
                continue
            self._apply(s, run, future.result(), answered=s.retrievals - 1)
        if missing:
            self._count(recomputed=len(missing))
            verification = self._search(np.stack([spec.query for _, run in missing for spec in run]))
            at = 0
            for s, run in missing:
                found = verification.found[at : at + len(run)]
                at += len(run)
                self._apply(s, run, Verification(found, verification.seconds), answered=s.retrievals - 1)

    def _apply(self, state: SpeculativeState, run: list[Speculation], verification: Verification, *, answered: int) -> None:
        """Compare a run of speculations with the base's answers; roll back from the first mismatch.

        `answered`: the number of the latest retrieval whose answer the pipeline already used; a
        mismatch at or before it is a rollback, a later one is just answered with the truth.
        """
        matched = len(run)
        for j, (spec, found) in enumerate(zip(run, verification.found)):
            self._add_to_cache(state, np.array([i for i, _ in found], dtype=np.int64))
            if tuple(i for i, _ in found[: self.topk]) != spec.ids:
                matched = j
                break
        state.window = (state.window + [(len(run), matched)])[-self.window :]
        state.verify_s = verification.seconds
        state.verifications += 1
        state.hits += matched
        self.strides[len(run)] += 1
        self._count(verifications=1, base_queries=len(run), hits=matched, misses=int(matched < len(run)))
        latest = state.retrievals - 1
        if matched < len(run):
            wrong = run[matched]
            state.misses += 1
            state.unverified, state.retrievals = [], wrong.number + 1
            state.docs = self._hits(verification.found[matched][: self.topk])
            if wrong.number <= answered:
                state.rollback = wrong.number
                state.rollbacks += 1
                self._count(rollbacks=1)
            return
        state.unverified = state.unverified[len(run) :]
        if run[-1].number == latest:  # the latest answer is confirmed: hand out the base's own hits
            state.docs = self._hits(verification.found[-1][: self.topk])

    # -- the cache -------------------------------------------------------------------------------------
    def _speculate(self, state: SpeculativeState, query: Vectors) -> tuple[tuple[int, ...], list[float]]:
        """Top-k of the cache for `query`, scored as the base scores: its answer whenever its top-k is cached."""
        k = min(self.topk, len(state.cache_ids))
        if self._faiss_metric is not None:
            import faiss

            index = faiss.IndexFlat(state.cache_vectors.shape[1], self._faiss_metric)
            index.add(state.cache_vectors)
            scores, local = index.search(query[None, :], k)
            picked, values = local[0], scores[0]
        else:
            all_scores = state.cache_vectors @ query
            picked = np.argsort(-all_scores, kind="stable")[:k]
            values = all_scores[picked]
        return tuple(int(state.cache_ids[i]) for i in picked), [float(v) for v in values]

    def _add_to_cache(self, state: SpeculativeState, ids: np.ndarray[Any, np.dtype[np.int64]]) -> None:
        """Insert documents (best first), newest kept when over `cache_limit`.

        Kept sorted by index so that ties break as the base breaks them, by document index.
        """
        new = ids[~np.isin(ids, state.cache_ids)]
        if not len(new):
            return
        merged = np.concatenate([state.cache_ids, new])
        vectors = self._vectors_of(new)
        merged_vectors = vectors if not len(state.cache_ids) else np.concatenate([state.cache_vectors, vectors])
        if len(merged) > self.cache_limit:
            merged, merged_vectors = merged[-self.cache_limit :], merged_vectors[-self.cache_limit :]
        order = np.argsort(merged, kind="stable")
        state.cache_ids, state.cache_vectors = merged[order], np.ascontiguousarray(merged_vectors[order])

    def _vectors_of(self, ids: np.ndarray[Any, np.dtype[np.int64]]) -> Vectors:
        if self._all_vectors is not None:
            return np.ascontiguousarray(self._all_vectors[ids], dtype=np.float32)
        vectors: Vectors = self.base.index.reconstruct_batch(ids)  # type: ignore[attr-defined]  # FAISS bases
        return vectors

    # -- helpers ---------------------------------------------------------------------------------------
    def _hits(self, found: Found) -> list[Hit]:
        docs = self.base.docs
        return [Hit(docs[i].id, docs[i].title, docs[i].text, round(score, 6)) for i, score in found[: self.topk]]

    def _checked(self, state: Any, method: str) -> SpeculativeState:
        if not isinstance(state, SpeculativeState):
            raise TypeError(
                f"SpeculativeRetriever.{method}() takes the state start() or retrieve() returned; got a {type(state).__name__}"
            )
        if state.corpus != self.corpus:
            raise ValueError(
                f"this state belongs to a retriever over another corpus ({state.corpus}, not {self.corpus}); "
                "pass the state this retriever's start() returned"
            )
        return state.copy()

    def _finish(self, state: SpeculativeState) -> SpeculativeState:
        """Choose the next stride (when "auto") from the latest measurements, and stamp the return time."""
        if self.stride == "auto" and state.decode_s is not None and state.verify_s is not None:
            gamma = estimate_gamma(state.window, self.gamma_max)
            state.stride = optimal_stride(
                state.decode_s, state.verify_s, gamma, asynchronous=self.async_verify, max_stride=self.max_stride
            )
        state.returned_at = time.time()
        return state

    def _count(self, **counts: int) -> None:
        with self._lock:
            self.totals.update(counts)
