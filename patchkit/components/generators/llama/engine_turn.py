"""How an engine that batches by itself spends one turn: the one description of it that `LlamaEngine`
runs and the planner's cost model (`scheduler/offline/costmodel.py`) replays. A leaf: it imports
nothing of patchkit, so the planner imports this module alone of the components.

A turn evaluates prompt tokens of the sequences still reading their prompts, oldest first, then
decodes one token for every sequence past its prompt in a single step (a sequence whose prompt ends
in the turn is in that step: the prompt's last token gave its first). While sequences decode, a turn's
prompt tokens are its step budget (`TurnSize.budget`): as many as take `interval - 1` decode steps at
the rates the engine measured (`Rates`), in whole slices, at least one, so that a decoding sequence's
tokens come at most about `interval` decode steps apart however long the prompts beside it; with
nothing decoding a turn takes `prompt_tokens`. Prompt tokens go in chunks: a
chunk runs from where a sequence's evaluation stands to the next multiple of `slice` (the engine's
unit of evaluation, aligned to position 0, of which its unit of prefix reuse is a multiple), or to
where its prompt, or the run of tokens before a document whose cells are placed (`kv_reuse="blend"`),
ends. A turn starts a chunk while at least `slice` of its
budget is left, so it evaluates at most its budget; a placed document takes the tokens evaluated for
it (its body, when evaluated alone first), at least one.

Prompt chunks and the decode step are separate `llama_decode` calls: over several KV streams
(`kv_unified=False`, which keeps answers independent of what runs beside them) llama.cpp splits a
batch into ubatches of equal tokens per stream, of consecutive stream ids (`split_equal`), so a prompt
chunk batched with decode tokens would run as other, smaller shapes anyway, and round otherwise.

An engine reports its sizes in its `stats()` as `prompt_tokens_per_turn`, `slice` and `step_interval`
(`TurnSize.reported`), so that the cost model replays the turns the engine runs, its budget from the
model's own rates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Chunk", "Pace", "Rates", "Reading", "Skip", "Threads", "TurnSize"]


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
    """An engine's turn: up to `prompt_tokens` prompt tokens, in chunks of at most `slice`, and while
    sequences decode its step budget, sized so that their tokens come at most about `interval` decode
    steps apart (`math.inf`: no budget but `prompt_tokens`); see the module's docstring."""

    prompt_tokens: int = 512
    slice: int = 64
    interval: float = math.inf

    def __post_init__(self) -> None:
        if not 1 <= self.slice <= self.prompt_tokens:
            raise ValueError(f"slice ({self.slice}) must be >= 1 and <= prompt_tokens ({self.prompt_tokens})")
        if not self.interval >= 1:
            raise ValueError(f"interval ({self.interval}) must be >= 1: decode steps between a sequence's tokens")

    @classmethod
    def reported(cls, stats: Mapping[str, Any]) -> TurnSize:
        """The sizes an engine's `stats()` report (`prompt_tokens_per_turn`, `slice`, `step_interval`;
        `block` for an engine whose slice is its block); the defaults for one that reports none."""
        default = cls()
        slice_ = stats.get("slice", stats.get("block", default.slice))
        return cls(int(stats.get("prompt_tokens_per_turn", default.prompt_tokens)), int(slice_),
                   float(stats.get("step_interval", default.interval)))

    def budget(self, decoding: int, step_ms: float | None, prompt_ms_per_token: float | None) -> int:
        """The prompt tokens a turn may evaluate before a decode step of `decoding` sequences that takes
        `step_ms`, prompts evaluated at `prompt_ms_per_token`: `prompt_tokens` when none decodes, else
        those that take `interval - 1` such steps, in whole slices, at least one and at most
        `prompt_tokens` (one slice while either rate is unknown)."""
        if decoding == 0 or math.isinf(self.interval):
            return self.prompt_tokens
        if not step_ms or not prompt_ms_per_token:
            return self.slice
        tokens = (self.interval - 1) * step_ms / prompt_ms_per_token
        return max(self.slice, min(self.prompt_tokens, int(tokens // self.slice) * self.slice))

    def prompt_chunks(self, readings: Sequence[Reading], budget: int | None = None) -> list[Chunk]:
        """The chunks one turn evaluates (and the documents it places) for `readings`, the sequences still
        reading their prompts, oldest first, within `budget` prompt tokens (default `prompt_tokens`;
        `budget()` gives a turn's); in order. Called by the engine at each turn, and by the cost model
        for each turn it replays."""
        budget, chunks = self.prompt_tokens if budget is None else budget, []
        for i, reading in enumerate(readings):
            at, skips = reading.evaluated, [s for s in reading.skips if s.at >= reading.evaluated]
            while at < reading.prompt and budget >= self.slice:
                skip = skips[0] if skips else None
                if skip is not None and at == skip.at:
                    chunks.append(Chunk(i, skip.at, skip.end, skip))
                    budget -= max(1, skip.cost)
                    at = skip.end
                    skips.pop(0)
                    continue
                end = min(reading.prompt, at - at % self.slice + self.slice, skip.at if skip is not None else reading.prompt)
                chunks.append(Chunk(i, at, end))
                budget -= end - at
                at = end
            if budget < self.slice:
                break
        return chunks


@dataclass
class Rates:
    """What an engine measured of its own speed, for its step budget: the ms a prompt token takes, a
    running mean over its prompt chunks, and the ms of a decode step by the sequences in it (a
    running mean for each number seen; an unseen number takes the nearest seen). Recent runs weigh
    `weight` each, so the rates follow the machine's load."""

    weight: float = 0.2
    prompt_ms_per_token: float | None = None
    step_ms: dict[int, float] = field(default_factory=dict)

    def prompt(self, tokens: int, ms: float) -> None:
        """A prompt chunk of `tokens` took `ms`."""
        if tokens > 0:
            self.prompt_ms_per_token = self._mean(self.prompt_ms_per_token, ms / tokens)

    def step(self, sequences: int, ms: float) -> None:
        """A decode step of `sequences` took `ms`."""
        self.step_ms[sequences] = self._mean(self.step_ms.get(sequences), ms)

    def step_of(self, sequences: int) -> float | None:
        """A decode step's ms for `sequences`, as measured (None before any step)."""
        if not self.step_ms:
            return None
        return self.step_ms[min(self.step_ms, key=lambda seen: (abs(seen - sequences), -seen))]

    def _mean(self, mean: float | None, value: float) -> float:
        return value if mean is None else mean + self.weight * (value - mean)


@dataclass
class Threads:
    """How many threads an engine's next `llama_decode` of one kind (prompt chunks, or decode steps)
    runs on, from what each count measured: the count of the least ms a unit of work (a prompt token,
    or a sequence of a decode step) while recent runs lasted, every count tried first, and every
    `explore`-th run another count again, in turn, so that a count that was slow while the machine was
    busy gets measured again. More threads than a context's cores' worth spin at llama.cpp's barriers
    when another process holds a core, so the count follows the load the machine bears as well as
    the work: a lone sequence on an idle machine takes every thread, one sharing it with other work
    fewer."""

    counts: tuple[int, ...]
    explore: int = 16
    weight: float = 0.2
    ms: dict[int, float] = field(default_factory=dict)
    runs: int = 0

    @classmethod
    def upto(cls, threads: int) -> Threads:
        """Counts 1, 2, 4, ... and `threads` itself."""
        counts = sorted({threads, *(1 << k for k in range(threads.bit_length()) if 1 << k < threads)})
        return cls(tuple(counts))

    def next(self) -> int:
        """The count the next run takes."""
        untried = [n for n in self.counts if n not in self.ms]
        if untried:
            return untried[0]
        best = min(self.counts, key=self.ms.__getitem__)
        if len(self.counts) > 1 and self.runs % self.explore == self.explore - 1:
            others = [n for n in self.counts if n != best]
            return others[(self.runs // self.explore) % len(others)]
        return best

    def ran(self, threads: int, units: int, ms: float) -> None:
        """A run on `threads` threads of `units` units of work took `ms`."""
        self.runs += 1
        if units > 0:
            value, mean = ms / units, self.ms.get(threads)
            self.ms[threads] = value if mean is None else mean + self.weight * (value - mean)


@dataclass
class Pace:
    """What an engine measured of its own speed, on up to `threads` threads: its `rates`, for its step
    budget, and the thread count of each kind of `llama_decode` ("prefill": prompt tokens, "decode":
    decode steps), chosen by `Threads`."""

    threads: int
    rates: Rates = field(default_factory=Rates)
    kinds: dict[str, Threads] = field(init=False)

    def __post_init__(self) -> None:
        self.kinds = {kind: Threads.upto(self.threads) for kind in ("prefill", "decode")}

    def budget(self, turn: TurnSize, decoding: int) -> int:
        """The prompt tokens of a turn beside a decode step of `decoding` sequences (`TurnSize.budget`)."""
        return turn.budget(decoding, self.rates.step_of(decoding), self.rates.prompt_ms_per_token)

    def ran(self, kind: str, threads: int, units: int, ms: float) -> None:
        """A `llama_decode` of `kind` on `threads` threads, of `units` prompt tokens or sequences, took `ms`."""
        self.kinds[kind].ran(threads, units, ms)
        if kind == "prefill":
            self.rates.prompt(units, ms)
        else:
            self.rates.step(units, ms)
