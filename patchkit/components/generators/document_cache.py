"""`DocumentCache`: a `LlamaEngine`'s document KV cache, the KV states of named prompt pieces kept in
host memory and restored into a slot instead of evaluated again.

The pieces are those a caller names (the system prompt, then each document in order); their states
live in a `KnowledgeTree` within `kv_cache_bytes`, evicted by frequency x recompute cost / size. Once
a prompt is evaluated, the engine has the cache `save` the pieces the tree lacks
(`llama_state_seq_get_data`, cut per piece at the block boundary at or before its end); when it
places a new prompt whose pieces the tree holds further than any slot, it has the cache `restore`
their states into the prompt's slot (`llama_state_seq_set_data`). A restored prefix is the cells a
fresh evaluation of the same blocks wrote, at the same positions and cells, so it changes no answer.

The engine's lock guards the tree: the engine calls `held`, `longest`, `count`, `restore` and
`stats` with it held, and `save`, which reads the slot's state outside it, on its own thread without
it. A state layout this llama.cpp does not write as `kv_state.py` reads it turns the cache off.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from patchkit.components.generators.kv_state import Cells, StateLayout, StateLayoutError
from patchkit.components.generators.kv_tree import KnowledgeTree, Node

__all__ = ["DocumentCache"]

logger = logging.getLogger(__name__)


class DocumentCache:
    """The document KV cache of one engine's llama.cpp context; off (holding nothing) when `budget` is 0."""

    def __init__(self, lib: Any, ctx: Any, model: Any, budget: int, block: int, lock: threading.Condition) -> None:
        self._lib, self._ctx, self._model, self._block, self._lock = lib, ctx, model, block, lock
        self._tree: KnowledgeTree[Cells] | None = KnowledgeTree(budget) if budget else None
        self._layout: StateLayout | None = None  # the sequence states' layout, read from the first one saved
        self._span = self._attention_span()
        self._counts = dict.fromkeys(("kv_cache_hits", "kv_cache_misses", "kv_cache_tokens_saved"), 0)
        self._seconds = 0.0  # saving and restoring states

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

    def restore(self, slot: int, path: list[Node[Cells]]) -> int:
        """Load the KV states along `path` into `slot`; the prompt tokens restored, 0 where llama.cpp
        refused them (the slot is empty then). Engine thread, lock held."""
        began = time.perf_counter()
        assert self._layout is not None  # the tree holds states only once one was read
        state = self._layout.join([node.state for node in path if node.state is not None])
        buffer = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        self._lib.llama_memory_seq_rm(self._ctx.memory, slot, -1, -1)
        loaded = self._lib.llama_state_seq_set_data(self._ctx.ctx, buffer, len(state), slot)
        self._seconds += time.perf_counter() - began
        if not loaded:
            logger.warning("llama.cpp did not restore a cached prefix of %d tokens; evaluating it instead", path[-1].kept)
            return 0
        self._counts["kv_cache_tokens_saved"] += path[-1].kept
        return path[-1].kept

    def save(self, slot: int, pieces: Sequence[tuple[int, ...]]) -> None:
        """Keep the pieces of the prompt just evaluated in `slot` that the cache lacks, each as the KV cells
        from its parent's end to the block boundary at or before its own end, as far as the budget
        allows. Engine thread, lock not held: the tree changes only here and in `longest`."""
        tree = self._tree
        if tree is None or not pieces:
            return
        with self._lock:
            path = tree.match(pieces)
        kept = [end - end % self._block for end in itertools.accumulate(map(len, pieces))]
        depth, known = len(path), path[-1].kept if path else 0
        if kept[-1] <= known:
            return  # nothing new past a block boundary
        last = kept.index(kept[-1])  # the pieces after it would hold no cells
        began = time.perf_counter()
        try:
            layout, cells = StateLayout.read(self.state(slot), self._lib.llama_model_n_layer(self._model.model))
        except StateLayoutError as exc:
            logger.warning("the document KV cache is off: %s", exc)
            with self._lock:
                self._tree = None
            return
        runs = [layout.cut(cells, kept[j - 1] if j else 0, kept[j]) for j in range(depth, last + 1)]
        with self._lock:
            self._layout, node = layout, path[-1] if path else tree.root
            for piece, end, run in zip(pieces[depth:], kept[depth:], runs):
                child = tree.insert(node, piece, end, run, run.nbytes, self._cost(run.start, run.end))
                if child is None:
                    break
                node = child
            tree.prune(node)
            self._seconds += time.perf_counter() - began

    def state(self, slot: int) -> memoryview:
        """The slot's sequence state, as llama.cpp saves it: its KV cells' positions, ids and data."""
        size = self._lib.llama_state_seq_get_size(self._ctx.ctx, slot)
        buffer = (ctypes.c_uint8 * size)()
        written = self._lib.llama_state_seq_get_data(self._ctx.ctx, buffer, size, slot)
        if written != size:
            raise StateLayoutError(f"llama.cpp wrote {written} bytes of a {size}-byte sequence state")
        return memoryview(buffer)

    def _cost(self, start: int, end: int) -> float:
        """What evaluating prompt positions [start, end) costs, in tokens at position 0: attention over the
        positions before each one adds to its dense layers' work."""
        return (end - start) * (1 + (start + end - 1) / (2 * self._span))

    def stats(self) -> dict[str, float]:
        """The cache's counters, `kv_cache_*` and `kv_cache_s` (the time spent saving and restoring), as
        `LlamaEngine.stats` reports them (lock held)."""
        tree = self._tree
        return {**self._counts, "kv_cache_s": self._seconds, "kv_cache_bytes_held": tree.bytes if tree else 0,
                "kv_cache_entries": tree.entries if tree else 0, "kv_cache_evictions": tree.evictions if tree else 0,
                "kv_cache_budget_bytes": tree.budget if tree else 0}
