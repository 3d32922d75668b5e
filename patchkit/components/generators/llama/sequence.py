"""A `LlamaEngine`'s sequences: a `LlamaSequence` is one submitted prompt, from waiting to finished, and
its caller reads the tokens the engine makes for it from a `TokenStream`.

`LlamaEngine.submit` makes both; the engine thread alone changes a sequence's fields (but `aborted`,
set under the engine's lock by `LlamaEngine.abort`) and ends its stream with `END` or an error.
`cut_pieces` and `common_prefix` compare prompts as tokens, for the engine and for
`LlamaCppGenerator`, which finds with `common_prefix` where a prompt's documents end; `prompt_left`
is what a turn of the engine reads of a sequence.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from patchkit.components.generators.llama.engine_turn import Reading, Skip

__all__ = ["END", "LlamaSequence", "TokenStream", "common_prefix", "cut_pieces", "prompt_left"]

END = None  # the last item of a stream's queue


@dataclass(eq=False)
class LlamaSequence:
    """One submitted prompt, from waiting to finished; its fields are the engine thread's, but `aborted`."""

    prompt: list[int]
    max_tokens: int
    sampler: Any  # a llama_sampler chain, owned by this sequence
    pieces: list[tuple[int, ...]] = field(default_factory=list)  # the prompt's leading pieces, for the document cache
    documents: list[tuple[int, int]] = field(default_factory=list)  # its documents' bodies, for blending
    stops: deque[Any] = field(default_factory=deque)  # where its evaluation stops to place a document's cells
    in_place: list[tuple[int, int]] = field(default_factory=list)  # bodies seen first here, kept once evaluated
    exact: int = 1 << 30  # prompt tokens whose KV a fresh evaluation would write alike: those before any placed
    exact_pieces: int = 1 << 30  # leading pieces within them, which the document cache may keep
    out: queue.SimpleQueue[bytes | BaseException | None] = field(default_factory=queue.SimpleQueue)
    slot: int = -1
    evaluated: int = 0  # prompt tokens in the slot's KV state, reused ones included
    generated: int = 0
    last: int = -1  # the token sampled last, fed to the next decode step
    aborted: bool = False
    top_logprobs: int | None = None  # where asked, the alternatives each token's logprobs entry lists
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # an entry per token made, complete at END


class TokenStream:
    """The byte pieces of one sequence's generated tokens, as the engine makes them. Iterate it on one
    thread; `close()` (or leaving a for loop over `pieces()` early) aborts the sequence: the engine drops
    it from the running batch and frees its slot at its next step."""

    def __init__(self, sequence: LlamaSequence, abort: Callable[[LlamaSequence], None]) -> None:
        self._sequence, self._abort = sequence, abort

    def pieces(self) -> Iterator[bytes]:
        try:
            while (item := self._sequence.out.get()) is not END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.close()

    def close(self) -> None:
        self._abort(self._sequence)

    @property
    def logprobs(self) -> list[dict[str, Any]]:
        """The logprobs entry of each token read so far (where its sampling asked for them)."""
        return self._sequence.logprobs


def cut_pieces(prompt: Sequence[int], pieces: Sequence[int]) -> list[tuple[int, ...]]:
    """The prompt's leading pieces, ending at the token offsets `pieces` (as `LlamaEngine.submit` takes them)."""
    ends = [0, *pieces]
    return [tuple(prompt[a:b]) for a, b in zip(ends, ends[1:])]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def prompt_left(sequence: LlamaSequence) -> Reading:
    """The sequence's prompt left, as a turn splits it (`engine_turn.py`): its placed documents' runs
    skipped, each costing its body's tokens when no cells of it are held (it is evaluated alone first)."""
    skips = tuple(Skip(stop.at, stop.end, 0 if stop.node is not None and stop.node.state is not None
                       else stop.end - stop.start) for stop in sequence.stops)
    return Reading(sequence.evaluated, len(sequence.prompt), skips)
