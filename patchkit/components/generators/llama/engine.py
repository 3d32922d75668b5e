"""`LlamaEngine`: continuous batching of many sequences in one llama.cpp context, with a prefix cache.

One engine thread owns the context. Callers on any thread `submit` a tokenized prompt and read its
tokens from the returned `TokenStream` (`sequence.py`). Each turn admits waiting sequences into free
slots, evaluates prompt slices within the turn's step budget (`engine_turn.py`: while sequences
decode, the slices that take `interval - 1` of their decode steps at the rates the engine measured,
so a decoding sequence never waits behind a whole prompt), then decodes one token for every running
sequence in a single `llama_decode`. Each kind of `llama_decode` runs on the thread count, up to
`threads`, it measured fastest (`engine_turn.Pace`): every core for a lone sequence that gains
from them, fewer where another process holds a core that more threads would wait for.

Each slot is its own KV stream of `n_ctx` cells (`kv_unified=False`): a sequence's attention runs over
the same cells in the same order alone or beside others, so greedy answers do not depend on what else
runs. A finished slot keeps its prompt's KV state: a new prompt takes the free slot sharing its longest
prefix and evaluates only the rest (or, when a running sequence shares a longer one, gets that stream
copied, `llama_memory_seq_cp`, and cut to the prefix). `cache_slots` slots beyond the `max_sequences`
that may run keep the prompts just finished (a grader's, whose documents the answer reads next)
cached under a full load, rather than given to the next waiting sequence.

Prompts are evaluated in slices of `slice` tokens aligned to position 0, and a prefix is reused only up
to a `block` boundary (whole slices; a block, not a slice, so that a shared system prompt alone takes
no cached prompt's slot): every prompt token is then computed in a `llama_decode` of the same tokens at
the same positions over the same KV cells, whether its prefix came from the cache or not. A matrix
product over another number of rows rounds differently, and at a near-tie the greedy answer would
follow; so reuse saves the work and changes no answer.

Beyond the slots, a document KV cache (`kv_cache_bytes`, `document_cache.py`) keeps in host memory the
KV states of the prompt pieces a caller names (the system prompt, then each document): a prompt whose
pieces it holds further than any slot gets them restored, evaluates the rest, and answers alike.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from patchkit.components.generators.llama.config import EngineConfig
from patchkit.components.generators.llama.document_cache import DocumentCache
from patchkit.components.generators.llama.engine_turn import Pace
from patchkit.components.generators.llama.kv_blend import Blender
from patchkit.components.generators.llama.kv_rope import KeyRotation
from patchkit.components.generators.llama.loading import choose_repack, model_params
from patchkit.components.generators.llama.sampling import GREEDY, SamplerParams, chain, token_logprobs
from patchkit.components.generators.llama.sequence import END, LlamaSequence, TokenStream, common_prefix, cut_pieces, prompt_left

__all__ = ["EngineConfig", "LlamaEngine"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """What a sequence's slot is loaded with before its prompt is evaluated: the document cache's `path`
    restored, or the stream of the running sequence `source` copied (None: neither); the prefix it
    keeps is the sequence's `evaluated`."""

    sequence: LlamaSequence
    path: list[Any]
    source: LlamaSequence | None


class LlamaEngine:
    """Continuous batching over one llama.cpp context; see the module's docstring. Thread-safe: `submit`,
    `stats` and `check` may be called from any thread."""

    def __init__(self, config: EngineConfig) -> None:
        import llama_cpp
        from llama_cpp import _internals, _logger

        _logger.set_verbose(False)  # as Llama(verbose=False): llama.cpp's own log only for errors

        self.config, self._lib = config, llama_cpp
        self.repack = choose_repack(config.repack)
        self.repack.log(config.model_path)
        params = model_params(llama_cpp, self.repack)
        self.model = _internals.LlamaModel(path_model=config.model_path, params=params, verbose=False)
        self._ctx = _internals.LlamaContext(model=self.model, params=self._context_params(), verbose=False)
        self._batch = _internals.LlamaBatch(n_tokens=config.n_batch, embd=0, n_seq_max=1, verbose=False)
        self._greedy = chain(llama_cpp, self.model.vocab, GREEDY)
        self._n_vocab = llama_cpp.llama_vocab_n_tokens(self.model.vocab)
        self._lock = threading.Condition()
        self._waiting: deque[LlamaSequence] = deque()
        self._running: list[LlamaSequence] = []
        # Idle slots, least recently used first, each with the prompt tokens its KV stream still holds.
        self._idle: OrderedDict[int, list[int]] = OrderedDict((slot, []) for slot in range(config.slots))
        self._counts = dict.fromkeys(
            ("requests", "finished", "aborted", "prompt_tokens_evaluated", "prompt_tokens_reused", "generated_tokens",
             "decode_steps", "decoded_sequences", "batched_steps", "cache_hits", "stream_copies", "max_active",
             "prompt_chunks", "mixed_steps", "step_prompt_tokens_max", "threads_prefill", "threads_decode"), 0)
        self._seconds = {"prefill_s": 0.0, "decode_s": 0.0}  # time inside llama_decode, per kind of batch
        self._pace, self._running_threads = Pace(config.threads), config.threads  # the engine thread's
        budget = config.kv_cache_bytes if config.prefix_cache else 0
        self._documents = DocumentCache(llama_cpp, self._ctx, self.model, budget, config.block, self._lock)
        self._blender: Blender | None = None
        if config.kv_reuse == "blend":
            if not llama_cpp.llama_memory_can_shift(self._ctx.memory):
                raise ValueError("kv_reuse='blend' moves cells to other positions, which this model's KV cache cannot")
            self._blender = Blender(llama_cpp, self._ctx, self._documents, scratch=config.slots, parking=config.n_ctx,
                                    share=config.recompute, evaluate=self._evaluate_alone,
                                    rotation=KeyRotation.of(llama_cpp, self.model))
        self._stopping = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="llama-engine", daemon=True)
        self._thread.start()

    def _context_params(self) -> Any:
        config, params = self.config, self._lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max = config.n_ctx * config.streams, config.streams
        params.n_batch = params.n_ubatch = config.n_batch
        params.kv_unified = False  # a stream per slot: see the module's docstring
        params.n_threads = params.n_threads_batch = config.threads
        # As Llama(flash_attn=False), so that answers equal create_chat_completion's.
        params.flash_attn_type = self._lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        return params

    # -- callers' side --------------------------------------------------------------------------------

    def tokenize(self, text: str, *, add_bos: bool) -> list[int]:
        """`text` (a chat-templated prompt, special tokens spelled out) as tokens; a BOS first when `add_bos`
        and the model's vocabulary adds one."""
        return list(self.model.tokenize(text.encode(), add_bos=add_bos, special=True))

    def piece(self, token: int) -> bytes:
        return bytes(self.model.token_to_piece(token)).rstrip(b"\0")

    def submit(
        self, prompt: Sequence[int], max_tokens: int, *, sampling: SamplerParams = GREEDY, pieces: Sequence[int] = (),
        documents: Sequence[tuple[int, int]] = (),
    ) -> TokenStream:
        """Queue a prompt for generation of at most `max_tokens` tokens, sampled as `sampling` says (sampling.py;
        greedy by default); called by any thread. The engine
        admits it at its next step when a slot and KV cells are free. `pieces`: where the prompt's leading
        pieces end (increasing token offsets: the system prompt's, then each document's), whose KV states
        the document cache keeps and restores; none, and the prompt reuses only the slots' prefixes.
        `documents`: the [start, end) token ranges of its documents' bodies, in order and before its last
        token, whose KV an engine with `kv_reuse="blend"` reuses wherever they appear (others ignore them)."""
        if not prompt or len(prompt) + max_tokens > self.config.n_ctx:
            raise ValueError(f"{len(prompt)} prompt tokens + max_tokens {max_tokens} must fit n_ctx ({self.config.n_ctx})")
        if any(not 0 < end <= len(prompt) for end in pieces) or any(a >= b for a, b in zip([0, *pieces], pieces)):
            raise ValueError(f"pieces ({list(pieces)}) must be increasing token offsets within the prompt's {len(prompt)}")
        if any(not 0 <= a < b < len(prompt) for a, b in documents) or any(
                b > c for (_, b), (c, _) in zip(documents, documents[1:])):
            raise ValueError(f"documents ({list(documents)}) must be ranges in order, before the prompt's last token")
        sampler = self._greedy if sampling.greedy else chain(self._lib, self.model.vocab, sampling)
        sequence = LlamaSequence(list(prompt), max_tokens, sampler, cut_pieces(prompt, pieces), list(documents))
        sequence.top_logprobs = sampling.logprobs
        with self._lock:
            self.check()
            if self._stopping:
                raise RuntimeError("the llama.cpp engine is closed")
            self._waiting.append(sequence)
            self._counts["requests"] += 1
            self._lock.notify()
        return TokenStream(sequence, self.abort)

    def abort(self, sequence: LlamaSequence) -> None:
        with self._lock:
            if not sequence.aborted:
                sequence.aborted = True
                self._lock.notify()

    def cached_pieces(self, prompt: Sequence[int], pieces: Sequence[int]) -> int:
        """How many of the prompt's leading pieces (ending where `pieces` say, as for `submit`) the document
        cache holds; called by any thread, to order documents for reuse."""
        with self._lock:
            return self._documents.held(cut_pieces(prompt, pieces))

    def stats(self) -> dict[str, float]:
        """Counters since start, read under the engine's lock so they agree with each other: the document
        cache's `kv_cache_*` (`DocumentCache.stats`); the turn's sizes, `prompt_tokens_per_turn`, `slice`,
        `step_interval` (which the cost model replays) and `block`; `mixed_steps` (decode steps that
        waited behind prompt chunks), `step_prompt_tokens_max` (the most prompt tokens one waited
        behind), `threads_prefill` and `threads_decode` (the threads the last chunk and step ran on); the
        context's `sequence_slots`, `cache_slots` and `kv_bytes` (every stream's KV cells, resident from
        the start); `weight_repack` and `cpu_amx` (1 or 0, `loading.py`); under blend, documents
        `blend_documents_reused` (placed from cells held), `_evaluated` (alone, then placed),
        `_in_place` (not held: evaluated in place) and `_kept_in_place` (kept for the next sight)."""
        with self._lock:
            counts: dict[str, float] = dict(self._counts)
            counts.update(prompt_tokens_per_turn=self.config.n_batch, block=self.config.block, slice=self.config.slice,
                          step_interval=self.config.interval,
                          weight_repack=float(self.repack.repack), cpu_amx=float(self.repack.amx),
                          sequence_slots=self.config.max_sequences, cache_slots=self.config.cache_slots,
                          kv_bytes=self.config.kv_bytes(self._lib, self.model.model))
            cached = sum(bool(kept) for kept in self._idle.values())
            counts.update(self._seconds, running=len(self._running), waiting=len(self._waiting), cache_entries=cached)
            counts.update(self._documents.stats())
            if self._blender is not None:
                counts.update(self._blender.counts)
        counts["mean_active_per_step"] = counts["decoded_sequences"] / max(1, counts["decode_steps"])
        return counts

    def check(self) -> None:
        """Raise if the engine thread died (its error as the cause)."""
        if self.error is not None or not self._thread.is_alive():
            raise RuntimeError(f"the llama.cpp engine thread stopped: {self.error!r}") from self.error

    def stop(self) -> None:
        """Stop the loop and end every stream with an error."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout=10)

    def close(self) -> None:
        """`stop`, then free the context (the model stays, for tokenizing). Idempotent."""
        self.stop()
        self._documents.close()
        if not self._thread.is_alive():
            self._batch.close()
            self._ctx.close()

    # -- the engine thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._turn():
                pass
            self._fail_all(RuntimeError("the llama.cpp engine is closed"))
        except BaseException as exc:  # noqa: BLE001 - every stream must end, whatever stopped the loop
            logger.exception("the llama.cpp engine failed")
            self.error = exc
            self._fail_all(RuntimeError(f"the llama.cpp engine failed: {exc}"))

    def _turn(self) -> bool:
        """One step: admit, drop aborted sequences, evaluate a prompt chunk, decode one token each."""
        with self._lock:
            while not (self._waiting or self._running or self._stopping):
                self._lock.wait()
            if self._stopping:
                return False
            for sequence in [s for s in self._running if s.aborted]:
                self._finish(sequence, aborted=True)
            placed = self._admit()
        for placement in placed:
            self._load(placement)
        self._prefill()
        self._decode()
        return True

    def _admit(self) -> list[Placement]:
        """Move waiting sequences into idle slots, oldest first, up to max_sequences running; what each
        slot must be loaded with (lock held: the loading itself runs without it)."""
        placed: list[Placement] = []
        if self._waiting and self._idle and len(self._running) < self.config.max_sequences:
            self._documents.settle()  # the pieces of every prompt evaluated so far, in the tree
        while self._waiting and self._idle and len(self._running) < self.config.max_sequences:
            sequence = self._waiting.popleft()
            if sequence.aborted:
                self._counts["aborted"] += 1
                continue
            placed.append(self._place(sequence))
            self._running.append(sequence)
            self._counts["max_active"] = max(self._counts["max_active"], len(self._running))
        return placed

    def _place(self, sequence: LlamaSequence) -> Placement:
        """Give the sequence the idle slot holding the longest prefix of its prompt (the least recently used
        one when none does), or a copy of a running slot's stream, or the least recently used slot with
        the document cache's states restored, whichever holds most; drop the slot's KV past the shared
        prefix, cut to a block boundary. The last prompt token is always evaluated again, for the logits
        the first sampled token comes from. Lock held; `_load` does what it decides. A stream may be
        copied from a sequence placed in the same turn: placements load in order, its own first."""
        limit = len(sequence.prompt) - 1 if self.config.prefix_cache else 0
        limit -= limit % self.config.block
        slot, reused = next(iter(self._idle)), 0
        for idle, kept in self._idle.items():
            if (common := self._aligned(min(limit, common_prefix(kept, sequence.prompt)))) > reused:
                slot, reused = idle, common
        shared = {s: self._aligned(min(limit, common_prefix(s.prompt[: min(s.evaluated, s.exact)], sequence.prompt)))
                  for s in self._running}
        source = max(shared, key=shared.__getitem__, default=None)
        copied = shared[source] if source is not None else 0
        path = self._documents.longest(sequence.pieces, limit)
        restore = bool(path) and path[-1].kept > max(reused, copied)
        if restore:
            slot = next(iter(self._idle))
        del self._idle[slot]
        self._documents.count(sequence.pieces, hit=restore)
        copy = not restore and copied > reused
        if copy:
            reused = copied
            self._counts["stream_copies"] += 1
        elif restore:
            reused = path[-1].kept
        sequence.slot, sequence.evaluated = slot, reused
        if self._blender is not None and (stops := self._blender.plan(sequence.prompt, sequence.documents, reused,
                                                                       sequence.in_place)):
            sequence.stops.extend(stops)
            sequence.exact = stops[0].at
            sequence.exact_pieces = sum(end <= stops[0].start for end in itertools.accumulate(map(len, sequence.pieces)))
        return Placement(sequence, path if restore else [], source if copy else None)

    def _load(self, placement: Placement) -> None:
        """Load a placed sequence's slot as `_place` decided: its cached path restored, or a running
        stream copied, then everything past the reused prefix dropped. Engine thread, lock not held:
        only this thread touches the context."""
        sequence, memory = placement.sequence, self._ctx.memory
        slot, reused = sequence.slot, sequence.evaluated
        if placement.path and not self._documents.restore(slot, placement.path):
            reused = 0
        elif placement.source is not None:
            # Across streams llama.cpp copies whole streams; the prefix cells never change while the source runs.
            # A source placed this turn was loaded just before: it holds less where its restore failed.
            reused = min(reused, placement.source.evaluated)
            self._lib.llama_memory_seq_rm(memory, slot, -1, -1)
            self._lib.llama_memory_seq_cp(memory, placement.source.slot, slot, -1, -1)
        self._lib.llama_memory_seq_rm(memory, slot, reused, -1)
        with self._lock:
            sequence.evaluated = reused
            self._counts["prompt_tokens_reused"] += reused
            self._counts["cache_hits"] += reused > 0

    def _aligned(self, tokens: int) -> int:
        return tokens - tokens % self.config.block

    def _prefill(self) -> None:
        """This turn's prompt chunks (`EngineConfig.turn`, within the step budget), one llama_decode each:
        llama.cpp would split a batch over several streams into shapes that round otherwise. A finished
        prompt gives its first token; under blend, evaluation stops before each document placed."""
        reading = [s for s in self._running if s.evaluated < len(s.prompt)]
        decoding = sum(1 for s in self._running if s.generated and s.evaluated == len(s.prompt))
        budget, read = self._pace.budget(self.config.turn, decoding), 0
        for chunk in self.config.turn.prompt_chunks([prompt_left(s) for s in reading], budget):
            sequence = reading[chunk.sequence]
            if chunk.skip is not None:
                assert self._blender is not None
                stop = sequence.stops[0]
                evaluated = self._blender.place(sequence.slot, sequence.prompt, stop)
                with self._lock:
                    sequence.stops.popleft()
                    sequence.evaluated = stop.end
                    self._counts["prompt_tokens_evaluated"] += evaluated
                continue
            start, end = chunk.start, chunk.end
            row = self._batch_tokens(sequence.prompt[start:end], start, sequence.slot)
            self._llama_decode("prefill", end - start)
            read += end - start
            if end == len(sequence.prompt):
                self._documents.save(sequence.slot, sequence.pieces[: sequence.exact_pieces])
                if self._blender is not None:
                    self._blender.keep_in_place(sequence.slot, sequence.prompt, sequence.in_place)
            with self._lock:
                sequence.evaluated = end
                self._counts["prompt_tokens_evaluated"] += end - start
                self._counts["prompt_chunks"] += 1
                if end == len(sequence.prompt):
                    self._sample(sequence, row)
        if decoding and read:  # a decode step follows, of sequences that waited behind `read` prompt tokens
            with self._lock:
                self._counts.update(mixed_steps=self._counts["mixed_steps"] + 1,
                                    step_prompt_tokens_max=max(self._counts["step_prompt_tokens_max"], read))

    def _evaluate_alone(self, tokens: Sequence[int], start: int, seq: int) -> None:
        """Evaluate `tokens` at positions start.. of sequence `seq`, n_batch at a time: a document alone."""
        for at in range(0, len(tokens), self.config.n_batch):
            chunk = tokens[at:at + self.config.n_batch]
            self._batch_tokens(chunk, start + at, seq)
            self._llama_decode("prefill", len(chunk))

    def _decode(self) -> None:
        """One token for every running sequence past its prompt, in one llama_decode, in slot order
        (llama.cpp runs it in ubatches of consecutive stream ids: as few as can be)."""
        ready = sorted((s for s in self._running if s.generated and s.evaluated == len(s.prompt)), key=lambda s: s.slot)
        if not ready:
            return
        rows = [self._batch_tokens([s.last], len(s.prompt) + s.generated - 1, s.slot) for s in ready]
        self._llama_decode("decode", len(ready))
        with self._lock:
            self._counts["decode_steps"] += 1
            self._counts["decoded_sequences"] += len(ready)
            self._counts["batched_steps"] += len(ready) > 1
            for sequence, row in zip(ready, rows):
                self._sample(sequence, row)

    def _batch_tokens(self, tokens: Sequence[int], start: int, slot: int) -> int:
        """Append tokens at positions start.. of `slot` to the batch, logits for the last; its row."""
        batch = self._batch.batch
        for i, token in enumerate(tokens):
            row = batch.n_tokens + i
            batch.token[row], batch.pos[row], batch.n_seq_id[row] = token, start + i, 1
            batch.seq_id[row][0], batch.logits[row] = slot, i == len(tokens) - 1
        batch.n_tokens += len(tokens)
        return int(batch.n_tokens - 1)

    def _llama_decode(self, kind: str, units: int) -> None:
        """Run and empty the batch of `units` (prompt tokens, or sequences) on its kind's fastest threads."""
        count = self._pace.kinds[kind].next()
        if count != self._running_threads:
            self._lib.llama_set_n_threads(self._ctx.ctx, count, count)
            self._running_threads = count
        began = time.perf_counter()
        status = self._lib.llama_decode(self._ctx.ctx, self._batch.batch)
        took = time.perf_counter() - began
        self._batch.batch.n_tokens = 0
        self._pace.ran(kind, count, units, took * 1000)
        with self._lock:
            self._seconds[kind + "_s"] += took
            self._counts["threads_" + kind] = count
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def _sample(self, sequence: LlamaSequence, row: int) -> None:
        """Sample the sequence's next token from `row`'s logits; stream it, or end the sequence (lock held)."""
        if sequence.aborted:
            self._finish(sequence, aborted=True)
            return
        token = self._lib.llama_sampler_sample(sequence.sampler, self._ctx.ctx, row)
        if self._lib.llama_vocab_is_eog(self.model.vocab, token):
            self._finish(sequence)
            return
        if sequence.top_logprobs is not None:
            logits = self._lib.llama_get_logits_ith(self._ctx.ctx, row)
            sequence.logprobs.append(token_logprobs(logits, self._n_vocab, token, sequence.top_logprobs, self.piece))
        sequence.generated += 1
        sequence.last = token
        self._counts["generated_tokens"] += 1
        sequence.out.put(self.piece(token))
        if sequence.generated >= sequence.max_tokens:
            self._finish(sequence)

    def _finish(self, sequence: LlamaSequence, *, aborted: bool = False) -> None:
        """End a running sequence; its slot goes idle keeping the prompt's KV state for reuse (lock held)."""
        kept = sequence.prompt[: min(sequence.evaluated, sequence.exact)]
        self._lib.llama_memory_seq_rm(self._ctx.memory, sequence.slot, len(kept), -1)
        self._running.remove(sequence)
        self._idle[sequence.slot] = kept
        if sequence.sampler is not self._greedy:
            self._lib.llama_sampler_free(sequence.sampler)
        self._counts["aborted" if aborted else "finished"] += 1
        sequence.out.put(END)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            self._stopping = True
            for sequence in [*self._running, *self._waiting]:
                sequence.out.put(error)
            self._running.clear()
            self._waiting.clear()
