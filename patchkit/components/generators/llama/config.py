"""`EngineConfig`: how a `LlamaEngine` is sized, checked where it is given (a `ValueError` naming the
options that conflict); `LlamaCppGenerator.engine_config` builds one from the component's options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from patchkit.components.generators.llama.engine_turn import TurnSize
from patchkit.components.generators.llama.loading import Repack, choose_repack

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    """How an engine is sized: up to `max_sequences` running at once, in slots of `n_ctx` tokens each, and
    `cache_slots` more slots that only idle slots' cached prompts fill; prompts evaluated `n_batch` tokens
    per step while nothing decodes, and while sequences decode within a step budget that keeps their
    tokens about `interval` decode steps apart (`math.inf`: n_batch a step always), `slice` tokens a
    `llama_decode`, prefixes reused in whole `block`s, on `threads` threads; `prefix_cache=False`
    evaluates every prompt in full (and keeps no cache slots, nor a document cache). `kv_cache_bytes`:
    the host memory the document KV cache may hold (0: none). `kv_reuse="blend"` also reuses documents'
    KV after any prefix, evaluating `recompute` of each placed document's tokens again (`kv_blend.py`);
    "exact" reuses prefixes only. `repack`: whether the weights load into llama.cpp's extra buffer
    types ("auto": not where the CPU reports AMX, see `loading.py`), decided where the engine loads."""

    model_path: str
    n_ctx: int = 2048
    max_sequences: int = 16
    cache_slots: int = 8
    n_batch: int = 512
    interval: float = 2.0  # decode steps a decoding sequence's tokens may be apart while prompts are read
    threads: int = 1
    prefix_cache: bool = True
    block: int = 64  # prefix reuse's unit, aligned to position 0, in whole slices
    slice: int = 16  # prompt tokens per llama_decode, aligned to position 0
    kv_cache_bytes: int = 0
    kv_reuse: str = "exact"  # or "blend": documents' KV reused at any position (`kv_blend.py`)
    recompute: float = 0.15  # under blend, the share of each placed document's leading tokens evaluated again
    repack: Repack = "auto"

    @property
    def slots(self) -> int:
        """KV streams in the context: the running sequences', and the cache's."""
        return self.max_sequences + (self.cache_slots if self.prefix_cache else 0)

    def __post_init__(self) -> None:
        if self.n_ctx < 16:
            raise ValueError(f"n_ctx ({self.n_ctx}) must be >= 16")
        if self.max_sequences < 1 or self.n_batch < self.max_sequences:
            raise ValueError(f"max_sequences ({self.max_sequences}) must be >= 1 and <= n_batch ({self.n_batch})")
        if self.cache_slots < 0:
            raise ValueError(f"cache_slots ({self.cache_slots}) must be >= 0")
        if not 1 <= self.block <= self.n_batch:
            raise ValueError(f"block ({self.block}) must be >= 1 and <= n_batch ({self.n_batch})")
        if not 1 <= self.slice <= self.block or self.block % self.slice:
            raise ValueError(f"slice ({self.slice}) must divide block ({self.block}): a reused prefix ends where a slice does")
        if not self.interval >= 1:
            raise ValueError(f"interval ({self.interval}) must be >= 1: decode steps between a sequence's tokens")
        if self.kv_cache_bytes < 0:
            raise ValueError(f"kv_cache_bytes ({self.kv_cache_bytes}) must be >= 0 (0 keeps no document KV cache)")
        if self.kv_reuse not in ("exact", "blend"):
            raise ValueError(f"kv_reuse ({self.kv_reuse!r}) must be 'exact' or 'blend'")
        if not 0.0 <= self.recompute <= 1.0:
            raise ValueError(f"recompute ({self.recompute}) must be within [0, 1]: the share of a document's tokens")
        choose_repack(self.repack)  # raises on a value that is not one
        if self.kv_reuse == "blend" and not (self.prefix_cache and self.kv_cache_bytes > 0):
            raise ValueError(f"kv_reuse='blend' keeps documents in the document KV cache: prefix_cache "
                             f"({self.prefix_cache}) must be True and kv_cache_bytes ({self.kv_cache_bytes}) > 0")

    @property
    def turn(self) -> TurnSize:
        """How a turn splits its prompt tokens: n_batch a turn, in chunks of `slice`, within the step
        budget of `interval` (`engine_turn.py`)."""
        return TurnSize(self.n_batch, self.slice, self.interval)

    @property
    def streams(self) -> int:
        """KV streams in the context: the slots, and under blend a scratch one for documents alone."""
        return self.slots + (self.kv_reuse == "blend")

    def kv_bytes(self, lib: Any, model: Any) -> int:
        """The bytes of the KV cells of an engine so sized over `model` (llama.cpp's): n_ctx cells a
        stream, each a key and a value of every layer in 16 bits (llama.cpp's default type), allocated
        whole, and so resident, when the context is made."""
        head_dim = lib.llama_model_n_embd(model) // lib.llama_model_n_head(model)
        per_cell = lib.llama_model_n_layer(model) * 2 * lib.llama_model_n_head_kv(model) * head_dim * 2
        return self.n_ctx * self.streams * per_cell
