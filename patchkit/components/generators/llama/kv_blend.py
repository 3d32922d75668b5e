"""Position-independent document KV (`kv_reuse="blend"`): a document's KV computed once and placed
wherever the document appears in a prompt, after any prefix (EPIC, CacheBlend).

A document pays for this only once it recurs: a body the tree does not hold is evaluated in place,
with the prompt, as the exact engine does (nothing evaluated alone, nothing placed: the prompt costs
what it costs exact). Once the prompt is evaluated, the body's cells are read out of the slot and
kept in the tree, their keys turned to where a body evaluated alone would stand (`keep_in_place`:
one read of the slot's state a prompt), so that its next sight places them. A stream where no
document recurs so costs what exact costs and one state read a prompt, and one where documents recur
evaluates each document once while its cells are held. The cells kept attended to the prompt before
them, where cells evaluated alone attend to nothing: either way, the placed document's first
`recompute` tokens, evaluated again in place, are what restore attention to its new neighbours.
A model whose keys `KeyRotation` cannot turn keeps no cells from a prompt: its engine notes each
body's digest in `Sightings`, a bounded window of the most recently seen bodies, and a body seen
again is evaluated alone, kept and placed as below.

A document's body (its tokens after the label "[i] " that numbers it in the prompt) is evaluated once
on its own, in a scratch sequence beyond the engine's slots, at the positions from `parking` (the
slots' context length: no prompt reaches there) on; its cells, read from that sequence alone, are
the document's entry in the document cache's tree, keyed by `BLEND` and its tokens, and evicted and
budgeted with the exact prefixes. To place it at positions [start, end) of a prompt, the engine
evaluates normally everything before start + k, where k is the recompute share of its tokens (the
label and its first tokens: EPIC's link tokens, which also take over the attention its first token
drew when it stood alone), then appends the document's cells from k on at their positions, their keys
rotated there on the host (`kv_rope.py`: the rotation costs the document's cells, where llama.cpp's
own shift, `llama_memory_seq_add`, rotates every cell of the context at its next decode; a model
whose keys `KeyRotation` cannot rotate keeps that shift). The question and every generated token are
evaluated normally, after the placed cells.

llama.cpp evaluates only past a sequence's last position and restores a sequence's state only whole
(`llama_state_seq_set_data` empties the sequence first), and with a KV stream per slot it shares
cells between sequences only by copying whole streams (`llama_memory_seq_cp` across streams copies
every cell of the source's stream and empties the destination's). So appending cells reads the
slot's state and writes it back with the cells added: one read and one write of the prompt so far
per document placed (`blend_state_bytes`), a few milliseconds against the evaluation it saves. A
shared stream would let a scratch sequence take the document and hand its cells over without a
copy, but every sequence's attention would then run over the cells of all of them.
For the same reason the tokens recomputed are each document's first ones: a token in the middle of a
placed document (CacheBlend's most deviating ones) could only be evaluated again with every cell
after it evaluated again too.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from patchkit.components.generators.llama.document_cache import DocumentCache
from patchkit.components.generators.llama.kv_rope import KeyRotation
from patchkit.components.generators.llama.kv_state import Cells, StateLayout
from patchkit.components.generators.llama.kv_tree import Node

__all__ = ["BLEND", "SIGHTINGS", "Blender", "Sightings", "Stop", "recomputed"]

BLEND = -1  # the first element of a document's key in the tree: no token id is negative, no prefix starts so
SIGHTINGS = 4096  # documents' digests a blend engine remembers having seen (about 100 bytes each)


class Sightings:
    """The digests of the `capacity` document bodies seen most recently, least recent first: whether a
    document recurs, in bounded memory (a digest, not its tokens, per document)."""

    def __init__(self, capacity: int = SIGHTINGS) -> None:
        if capacity < 1:
            raise ValueError(f"capacity ({capacity}) must be >= 1")
        self.capacity = capacity
        self._seen: OrderedDict[int, None] = OrderedDict()

    def recurs(self, body: Sequence[int]) -> bool:
        """Note a sight of `body`; whether it was seen before within the window (the oldest sight is
        forgotten past `capacity`)."""
        digest = hash(tuple(body))
        seen = digest in self._seen
        self._seen[digest] = None
        self._seen.move_to_end(digest)
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return seen

    def __len__(self) -> int:
        return len(self._seen)


@dataclass
class Stop:
    """Where a prompt's evaluation stops to place a document: at `at` (its start plus the tokens evaluated
    again), its body's cells from there to `end` come from `node` (None: evaluated alone first)."""

    at: int
    start: int
    end: int
    node: Node[Cells] | None


def recomputed(tokens: int, share: float) -> int:
    """The leading tokens of a `tokens`-token document evaluated again where it is placed: `share` of
    them, rounded up."""
    return min(tokens, math.ceil(share * tokens - 1e-9))


class Blender:
    """Places documents' cells into an engine's slots (see the module's docstring). The engine calls
    `plan` under its lock when it places a prompt and `place` on its own thread, without the lock,
    when the prompt's evaluation reaches a stop."""

    def __init__(self, lib: Any, ctx: Any, cache: DocumentCache, scratch: int, parking: int, share: float,
                 evaluate: Callable[[Sequence[int], int, int], None], rotation: KeyRotation | None = None,
                 sightings: int = SIGHTINGS) -> None:
        self._lib, self._ctx, self._cache, self.scratch, self.parking = lib, ctx, cache, scratch, parking
        self.share, self._evaluate, self.rotation = share, evaluate, rotation
        self.seen = Sightings(sightings)
        self.counts: dict[str, float] = dict.fromkeys(
            ("blend_documents_reused", "blend_documents_evaluated", "blend_documents_in_place",
             "blend_documents_kept_in_place", "blend_tokens_reused", "blend_tokens_recomputed", "blend_s",
             "blend_state_bytes", "blend_cells_rotated", "blend_context_shifts"), 0)

    def plan(self, prompt: Sequence[int], spans: Sequence[tuple[int, int]], reused: int,
             in_place: list[tuple[int, int]] | None = None) -> list[Stop]:
        """The stops of a prompt whose first `reused` tokens come from a slot or the exact cache: one per
        document body [start, end) after them whose cells the tree holds (counted as used), in order. A
        body not held gets no stop: it is evaluated in place, with the prompt, counted in
        `blend_documents_in_place` and added to `in_place`, whose cells `keep_in_place` keeps once the
        prompt is evaluated. Where keys cannot be turned on the host (no `rotation`), a body not held
        but seen before (its digest in `seen`) is evaluated alone first instead, and placed. Lock held."""
        tree, stops, after = self._cache.tree, [], reused
        if tree is None:
            return []
        for start, end in spans:
            body = prompt[start:end]
            recurs = self.seen.recurs(body)  # every body is a sight, reused as a prefix or not
            if start < after:
                continue
            at = start + recomputed(end - start, self.share)
            at += at == after  # a token evaluated between two placements applies the first one's shift
            if at >= end:
                continue
            found = tree.match([(BLEND, *body)])
            if not found and (self.rotation is not None or not recurs):
                self.counts["blend_documents_in_place"] += 1
                if in_place is not None and self.rotation is not None:
                    in_place.append((start, end))
                continue
            tree.use(found)
            stops.append(Stop(at, start, end, found[0] if found else None))
            after = end
        return stops

    def place(self, slot: int, prompt: Sequence[int], stop: Stop) -> int:
        """Append the cells of `stop`'s document from its recompute point on to `slot`, whose cells end
        just before it, and move them into place; the tokens evaluated for it (its body, when no cells
        were held). Engine thread, lock not held. `blend_s` counts the placing, not the evaluation alone;
        `blend_state_bytes` the bytes of the slot's state read and written; `blend_cells_rotated` the cells
        whose keys were rotated here, `blend_context_shifts` the placings left to llama.cpp's shift."""
        evaluated, cells = 0, stop.node.state if stop.node is not None else None
        if cells is None:
            cells = self.alone(prompt[stop.start:stop.end])
            evaluated = stop.end - stop.start
        began = time.perf_counter()
        layout = self._cache.layout
        assert layout is not None  # known once any cells were read
        shift = stop.at - stop.start
        tail = layout.cut(cells, cells.start + shift, cells.end)
        rotate = self.rotation is not None and self.rotation.fits(layout)
        if rotate:
            assert self.rotation is not None
            tail = self.rotation.moved(layout, tail, stop.at)
        state = self._cache.read(slot)
        try:
            _, held = StateLayout.read(state, self._cache.n_layer)
            self.counts["blend_state_bytes"] += state.size + layout.size([held, tail])
            self._cache.load(slot, [held, tail])
        finally:
            self._cache.buffers.give(state.base if state.base is not None else state)
        if rotate:
            self.counts["blend_cells_rotated"] += tail.end - tail.start
        else:
            self._lib.llama_memory_seq_add(self._ctx.memory, slot, tail.start, tail.end, stop.at - tail.start)
            self.counts["blend_context_shifts"] += 1
        kind = "evaluated" if evaluated else "reused"
        self.counts[f"blend_documents_{kind}"] += 1
        self.counts["blend_tokens_reused"] += 0 if evaluated else stop.end - stop.at
        self.counts["blend_tokens_recomputed"] += stop.at - stop.start
        self.counts["blend_s"] += time.perf_counter() - began
        return evaluated

    def keep_in_place(self, slot: int, prompt: Sequence[int], spans: Sequence[tuple[int, int]]) -> None:
        """Keep in the tree the cells of the document bodies [start, end) that `slot`'s prompt, just
        evaluated, holds in place: each body's cells, their keys turned to positions from `parking`, as
        if evaluated alone there, so that its next sight places them instead of evaluating it alone. They
        attended to the prompt before them, as a placed document's recomputed tokens do. One read of the
        slot's state; `blend_documents_kept_in_place` counts the bodies. Engine thread, lock not held."""
        if self.rotation is None or not spans:
            return
        began = time.perf_counter()
        state = self._cache.read(slot)
        try:
            layout, cells = StateLayout.read(state, self._cache.n_layer)
            if not self.rotation.fits(layout):
                return
            bodies = [layout.cut(cells, start, end) for start, end in spans]  # out of the buffer
            self.counts["blend_state_bytes"] += state.size
        finally:
            self._cache.buffers.give(state.base if state.base is not None else state)
        for (start, end), body in zip(spans, bodies):
            self._cache.keep_document((BLEND, *prompt[start:end]), layout, self.rotation.moved(layout, body, self.parking))
            self.counts["blend_documents_kept_in_place"] += 1
        self.counts["blend_s"] += time.perf_counter() - began

    def alone(self, body: Sequence[int]) -> Cells:
        """Evaluate a document's body on its own in the scratch sequence, from `parking` on, and keep its
        cells in the tree (as far as the budget allows); its cells. Engine thread, lock not held."""
        memory = self._ctx.memory
        self._lib.llama_memory_seq_rm(memory, self.scratch, -1, -1)
        self._evaluate(body, self.parking, self.scratch)
        state = self._cache.read(self.scratch)
        try:
            layout, cells = StateLayout.read(state, self._cache.n_layer)
            cells = layout.cut(cells, cells.start, cells.end)  # out of the buffer, once
        finally:
            self._cache.buffers.give(state.base if state.base is not None else state)
            self._lib.llama_memory_seq_rm(memory, self.scratch, -1, -1)
        self._cache.keep_document((BLEND, *body), layout, cells)
        return cells
