"""`DocumentCache`: a `LlamaEngine`'s document KV cache, the KV states of named prompt pieces kept in
host memory and restored into a slot instead of evaluated again.

The pieces are those a caller names (the system prompt, then each document in order); their states
live in a `KnowledgeTree` within `kv_cache_bytes`, evicted by frequency x recompute cost / size. Once
a prompt is evaluated, the engine has the cache `save` the pieces the tree lacks, each cut at the
block boundary at or before its end; when it places a new prompt whose pieces the tree holds further
than any slot, it has the cache `restore` their states into the prompt's slot
(`llama_state_seq_set_data`). A restored prefix is the cells a fresh evaluation of the same blocks
wrote, at the same positions and cells, so it changes no answer.

The cache stays off the engine's decode loop. A save costs the engine thread one read of the slot's
state by llama.cpp (`llama_state_seq_get_data`, which reads a sequence's cells only whole) into a
warm buffer reused from save to save; a saver thread then copies out the new pieces' cells, once,
and adds them to the tree while the engine decodes. A restore writes the prefix's cells once into a
warm buffer and hands it to llama.cpp, without the engine's lock. The engine waits for saves still
being cut only when it next places a prompt, so that a prompt sees every piece saved before it.

The engine's lock guards the tree and the counters: the engine calls `held`, `longest`, `count`,
`settle` and `stats` with it held, `save` and `restore` without it; the saver takes it to insert. A
state layout this llama.cpp does not write as `kv_state.py` reads it turns the cache off.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from patchkit.components.generators.llama.kv_state import Cells, StateLayout, StateLayoutError
from patchkit.components.generators.llama.kv_tree import KnowledgeTree, Node

__all__ = ["DocumentCache"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Save:
    """A slot's state read for saving, and which of its prompt's pieces to keep from it: those from
    `depth` on, ending at the block boundaries `kept`, up to the piece `last`."""

    state: np.ndarray
    pieces: Sequence[tuple[int, ...]]
    kept: list[int]
    depth: int
    last: int


class StateBuffers:
    """Byte buffers reused from one state to the next: a fresh buffer of a slot's state (13 MB for 576
    tokens of SmolLM2) costs the thread that first writes it a page fault every 4 KiB."""

    KEEP = 3  # buffers kept free: a save in flight, a restore, one spare

    def __init__(self) -> None:
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        """A buffer of at least `size` bytes: the smallest free one that fits, else a new one."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.size >= size]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].size))
        return np.empty(size, np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        """Return a buffer taken; the largest few are kept."""
        with self._lock:
            self._free = sorted([*self._free, buffer], key=lambda b: b.size)[-self.KEEP:]


def pointer(buffer: np.ndarray) -> Any:
    """`buffer`'s bytes as the `uint8_t *` llama.cpp's state functions take."""
    return buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


class DocumentCache:
    """The document KV cache of one engine's llama.cpp context; off (holding nothing) when `budget` is 0.
    `close` stops its saver thread."""

    def __init__(self, lib: Any, ctx: Any, model: Any, budget: int, block: int, lock: threading.Condition) -> None:
        self._lib, self._ctx, self._model, self._block, self._lock = lib, ctx, model, block, lock
        self._tree: KnowledgeTree[Cells] | None = KnowledgeTree(budget) if budget else None
        self._layout: StateLayout | None = None  # the sequence states' layout, read from the first one saved
        self.n_layer = lib.llama_model_n_layer(model.model)
        self._span = self._attention_span()
        self._counts = dict.fromkeys(("kv_cache_hits", "kv_cache_misses", "kv_cache_tokens_saved",
                                      "kv_cache_state_bytes_read", "kv_cache_bytes_joined"), 0)
        self._seconds = 0.0  # saving and restoring states, on the engine thread
        self.buffers = StateBuffers()
        self._jobs: queue.SimpleQueue[_Save | None] = queue.SimpleQueue()
        self._pending = 0  # saves read and not yet in the tree (lock held)
        self._saver: threading.Thread | None = None
        if self._tree is not None:
            self._saver = threading.Thread(target=self._save_loop, name="kv-cache-saver", daemon=True)
            self._saver.start()

    @property
    def tree(self) -> KnowledgeTree[Cells] | None:
        """The tree of states (lock held), None when the cache is off."""
        return self._tree

    @property
    def layout(self) -> StateLayout | None:
        """The layout of this context's sequence states, known once a state was read."""
        return self._layout

    def _attention_span(self) -> float:
        """The cached positions whose attention costs a prompt token as much as its dense layers: the scale of
        the recompute cost, which grows with a piece's position."""
        lib, model = self._lib, self._model.model
        n_embd, n_layer = lib.llama_model_n_embd(model), lib.llama_model_n_layer(model)
        dense = 2 * max(1, lib.llama_model_n_params(model) - lib.llama_vocab_n_tokens(self._model.vocab) * n_embd)
        return float(dense / n_layer / (4 * n_embd))  # per position and layer: a query-key product and a value sum

    def held(self, pieces: Sequence[tuple[int, ...]]) -> int:
        """How many of a prompt's leading pieces the cache holds (lock held)."""
        return len(self._tree.match(pieces)) if self._tree is not None else 0

    def longest(self, pieces: Sequence[tuple[int, ...]], limit: int) -> list[Node[Cells]]:
        """The longest path along a prompt's pieces that ends within `limit` tokens; every piece of it
        found counts as used, whoever serves the prompt (lock held)."""
        if self._tree is None or not pieces:
            return []
        path = self._tree.match(pieces)
        self._tree.use(path)
        while path and path[-1].kept > limit:
            path.pop()
        return path

    def count(self, pieces: Sequence[tuple[int, ...]], *, hit: bool) -> None:
        """Count a placed prompt with pieces as a hit (its prefix restored from here) or a miss (lock held)."""
        if pieces and self._tree is not None:
            self._counts["kv_cache_hits" if hit else "kv_cache_misses"] += 1

    def settle(self) -> None:
        """Wait until every save read so far is in the tree; called by the engine thread, lock held, before
        it looks a prompt up, so that the prompt finds the pieces of every prompt evaluated before it."""
        while self._pending:
            self._lock.wait()

    def restore(self, slot: int, path: list[Node[Cells]]) -> int:
        """Load the KV states along `path` (looked up under the lock) into `slot`; the prompt tokens
        restored, 0 where llama.cpp refused them (the slot is empty then). Engine thread, lock not held:
        the states are never changed, only dropped from the tree."""
        runs = [node.state for node in path if node.state is not None]
        loaded = self.load(slot, runs)
        with self._lock:
            if not loaded:
                logger.warning("llama.cpp did not restore a cached prefix of %d tokens; evaluating it instead", path[-1].kept)
                return 0
            self._counts["kv_cache_tokens_saved"] += path[-1].kept
        return path[-1].kept

    def load(self, slot: int, runs: Sequence[Cells]) -> bool:
        """Replace `slot`'s cells with `runs` (at the positions their metadata names), joined once into a
        warm buffer; whether llama.cpp took them. Engine thread, lock not held."""
        began = time.perf_counter()
        assert self._layout is not None  # the tree holds states only once one was read
        buffer = self.buffers.take(self._layout.size(runs))
        try:
            state = self._layout.join_into(runs, buffer)
            self._lib.llama_memory_seq_rm(self._ctx.memory, slot, -1, -1)
            loaded = self._lib.llama_state_seq_set_data(self._ctx.ctx, pointer(state), state.size, slot)
        finally:
            self.buffers.give(buffer)
        with self._lock:
            self._counts["kv_cache_bytes_joined"] += state.size
            self._seconds += time.perf_counter() - began
        return bool(loaded)

    def save(self, slot: int, pieces: Sequence[tuple[int, ...]]) -> None:
        """Keep the pieces of the prompt just evaluated in `slot` that the cache lacks, each as the KV cells
        from its parent's end to the block boundary at or before its own end, as far as the budget
        allows. Engine thread, lock not held: it reads the slot's state and leaves the rest to the saver."""
        tree = self._tree
        if tree is None or not pieces:
            return
        with self._lock:
            path = tree.match(pieces)
        kept = [end - end % self._block for end in itertools.accumulate(map(len, pieces))]
        depth, known = len(path), path[-1].kept if path else 0
        if kept[-1] <= known:
            return  # nothing new past a block boundary
        began = time.perf_counter()
        state = self.read(slot)
        with self._lock:
            self._pending += 1
            self._counts["kv_cache_state_bytes_read"] += state.size
            self._seconds += time.perf_counter() - began
        self._jobs.put(_Save(state, pieces, kept, depth, kept.index(kept[-1])))

    def read(self, slot: int) -> np.ndarray:
        """The slot's sequence state, as llama.cpp saves it, in a buffer of `buffers` (give it back)."""
        size = self._lib.llama_state_seq_get_size(self._ctx.ctx, slot)
        buffer = self.buffers.take(size)
        written = self._lib.llama_state_seq_get_data(self._ctx.ctx, pointer(buffer), size, slot)
        if written != size:
            self.buffers.give(buffer)
            raise StateLayoutError(f"llama.cpp wrote {written} bytes of a {size}-byte sequence state")
        return buffer[:size]

    def state(self, slot: int) -> bytes:
        """The slot's sequence state as bytes: its KV cells' positions, ids and data."""
        buffer = self.read(slot)
        try:
            return buffer.tobytes()
        finally:
            self.buffers.give(buffer.base if buffer.base is not None else buffer)

    def _save_loop(self) -> None:
        """The saver thread: cut each state read into the pieces it adds, copying their cells once."""
        while (job := self._jobs.get()) is not None:
            try:
                self._keep(job)
            except Exception:  # noqa: BLE001 - a failed save loses a cache entry, never the engine
                logger.exception("the document KV cache could not keep a prompt's pieces")
            finally:
                self.buffers.give(job.state.base if job.state.base is not None else job.state)
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

    def _keep(self, job: _Save) -> None:
        try:
            layout, cells = StateLayout.read(job.state, self.n_layer)
        except StateLayoutError as exc:
            logger.warning("the document KV cache is off: %s", exc)
            with self._lock:
                self._tree = None
            return
        kept = job.kept
        runs = [layout.cut(cells, kept[j - 1] if j else 0, kept[j]) for j in range(job.depth, job.last + 1)]
        with self._lock:
            tree = self._tree
            if tree is None:
                return
            self._layout = layout
            path = tree.match(job.pieces[: job.depth])
            if len(path) < job.depth:
                return  # the pieces these follow were evicted meanwhile
            node = path[-1] if path else tree.root
            for piece, end, run in zip(job.pieces[job.depth:], kept[job.depth:], runs):
                child = tree.insert(node, piece, end, run, run.nbytes, self._cost(run.start, run.end))
                if child is None:
                    break
                node = child
            tree.prune(node)

    def keep_document(self, key: tuple[int, ...], layout: StateLayout, cells: Cells) -> None:
        """Keep a document's cells, evaluated alone, under the tree's root as `key`, as far as the budget
        allows; its recompute cost is its tokens' at the start of a prompt. Engine thread, lock not held."""
        with self._lock:
            self._layout = layout
            if self._tree is not None:
                self._tree.insert(self._tree.root, key, cells.end - cells.start, cells, cells.nbytes,
                                  self._cost(0, cells.end - cells.start))

    def close(self) -> None:
        """Stop the saver thread once the saves queued are kept; called by the engine when it closes."""
        if self._saver is not None:
            self._jobs.put(None)
            self._saver.join(timeout=10)

    def _cost(self, start: int, end: int) -> float:
        """What evaluating prompt positions [start, end) costs, in tokens at position 0: attention over the
        positions before each one adds to its dense layers' work."""
        return (end - start) * (1 + (start + end - 1) / (2 * self._span))

    def stats(self) -> dict[str, float]:
        """The cache's counters, `kv_cache_*`, as `LlamaEngine.stats` reports them (lock held):
        `kv_cache_hits` (prompts whose prefix it restored), `kv_cache_misses` (prompts with pieces it
        restored nothing of: it held none of them, or a slot held as much), `kv_cache_tokens_saved`
        (prompt tokens restored from it), `kv_cache_bytes_held` (within `kv_cache_budget_bytes`),
        `kv_cache_entries` (pieces held), `kv_cache_evictions`, `kv_cache_s` (the engine thread's time
        saving and restoring), `kv_cache_state_bytes_read` (slot states read for saving),
        `kv_cache_bytes_joined` (states written for restoring)."""
        tree = self._tree
        return {**self._counts, "kv_cache_s": self._seconds, "kv_cache_bytes_held": tree.bytes if tree else 0,
                "kv_cache_entries": tree.entries if tree else 0, "kv_cache_evictions": tree.evictions if tree else 0,
                "kv_cache_budget_bytes": tree.budget if tree else 0}
