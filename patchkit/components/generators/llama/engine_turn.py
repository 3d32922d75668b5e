"""How an engine that batches by itself spends one turn: the one description of it that `LlamaEngine`
runs and the planner's cost model (`scheduler/offline/costmodel.py`) replays. A leaf: it imports
nothing of patchkit, so the planner imports this module alone of the components.

A turn evaluates prompt tokens of the sequences still reading their prompts, oldest first, then
decodes one token for every sequence past its prompt in a single step (a sequence whose prompt ends
in the turn is in that step: the prompt's last token gave its first). Prompt tokens go in chunks: a
chunk runs from where a sequence's evaluation stands to the next multiple of `block` (the unit of
prefix reuse, aligned to position 0), or to where its prompt, or the run of tokens before a document
whose cells are placed (`kv_reuse="blend"`), ends. A turn starts a chunk while at least `block` of its
`prompt_tokens` are left, so it evaluates at most `prompt_tokens`; a placed document takes the tokens
evaluated for it (its body, when evaluated alone first), at least one.

An engine reports its sizes in its `stats()` as `prompt_tokens_per_turn` and `block`
(`TurnSize.reported`), so that the cost model replays the turns the engine runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Chunk", "Reading", "Skip", "TurnSize"]


@dataclass(frozen=True)
class Skip:
    """Prompt tokens [at, end) a sequence does not evaluate: a document's cells placed there instead, which
    takes `cost` of the turn's prompt tokens (those evaluated for it elsewhere; at least 1 is charged)."""

    at: int
    end: int
    cost: int = 0


@dataclass(frozen=True)
class Reading:
    """A sequence still reading its prompt: `evaluated` of its `prompt` tokens are in its KV state, and
    it skips the runs `skips` further on, in order."""

    evaluated: int
    prompt: int
    skips: tuple[Skip, ...] = ()


@dataclass(frozen=True)
class Chunk:
    """One piece of a turn's prompt work for `readings[sequence]`: evaluate its tokens [start, end) in
    one batch, or, with `skip`, place that skip's cells."""

    sequence: int
    start: int
    end: int
    skip: Skip | None = None


@dataclass(frozen=True)
class TurnSize:
    """An engine's turn: up to `prompt_tokens` prompt tokens, in chunks of at most `block` (see the
    module's docstring)."""

    prompt_tokens: int = 512
    block: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.block <= self.prompt_tokens:
            raise ValueError(f"block ({self.block}) must be >= 1 and <= prompt_tokens ({self.prompt_tokens})")

    @classmethod
    def reported(cls, stats: Mapping[str, Any]) -> TurnSize:
        """The sizes an engine's `stats()` report (`prompt_tokens_per_turn`, `block`); the defaults for
        one that reports none."""
        default = cls()
        return cls(int(stats.get("prompt_tokens_per_turn", default.prompt_tokens)), int(stats.get("block", default.block)))

    def prompt_chunks(self, readings: Sequence[Reading]) -> list[Chunk]:
        """The chunks one turn evaluates (and the documents it places) for `readings`, the sequences still
        reading their prompts, oldest first; in order. Called by the engine at each turn, and by the
        cost model for each turn it replays."""
        budget, chunks = self.prompt_tokens, []
        for i, reading in enumerate(readings):
            at, skips = reading.evaluated, [s for s in reading.skips if s.at >= reading.evaluated]
            while at < reading.prompt and budget >= self.block:
                skip = skips[0] if skips else None
                if skip is not None and at == skip.at:
                    chunks.append(Chunk(i, skip.at, skip.end, skip))
                    budget -= max(1, skip.cost)
                    at = skip.end
                    skips.pop(0)
                    continue
                end = min(reading.prompt, at - at % self.block + self.block, skip.at if skip is not None else reading.prompt)
                chunks.append(Chunk(i, at, end))
                budget -= end - at
                at = end
            if budget < self.block:
                break
        return chunks
