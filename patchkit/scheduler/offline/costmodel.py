"""The cost model of an engine that batches by itself: what a call costs from its token counts.

An engine such as `LlamaEngine` runs many sequences in one context, turn after turn: it evaluates
prompt chunks of the sequences still reading their prompts (oldest first), within a step budget
while sequences decode (the prompt tokens that take `interval - 1` decode steps, at the model's own
rates, as the engine sizes it at its measured ones), then decodes one token for every sequence past
its prompt in a single step. How a turn splits its prompt tokens is
`TurnSize` (`components/generators/llama/engine_turn.py`, a leaf beside the engine: the one module of
the components the planner imports), the one function the engine runs and `run_ms` replays, at the
sizes the engine reports in its stats. Its costs are then a few numbers and a curve, per thread
count:

- `prompt_ms_per_token`: prompt evaluation is compute-bound, one sequence at a time, so it costs the
  same per token whatever runs beside it;
- `key_ms`: but a token's attention reads every position before it, so a token costs `key_ms` more
  for each: a prompt's tail evaluated after a cached prefix, and the steps of a sequence with a long
  context, cost more than the same tokens near position 0 (the same `key_ms` for both);
- `step`: one decode step's milliseconds by the sequences in it (a `PiecewiseLinear`): batching
  shares the weights' reads between sequences, so a step of 8 costs far less than 8 steps of 1;
- `call_ms`: what a call costs beyond the engine's evaluation (the process hop, the chat template,
  tokenizing, sampling);
- `place_ms`: under `kv_reuse="blend"`, placing one document's cached cells into a prompt (a read
  and a write of the slot's state, its keys rotated to their positions on the host): what a document
  reused at any position costs instead of its tokens, which the call then does not evaluate (0 for
  engines that place none). The engine's `blend_s` holds all of it: no shift of the context is left
  for the next prompt chunk's evaluation to pay, so `prompt_ms_per_token` stays the tokens' own.
  A document whose cells a blend engine does not hold is evaluated in place, as exact evaluates it:
  its tokens are among those the call evaluates, and it is not placed (`blend_documents_in_place`,
  which the model does not read); the documents placed are those held, placed from their cells
  (`blend_documents_reused`), or, on a model whose keys are not turned on the host, those seen
  before and evaluated alone first (`blend_documents_evaluated`, their bodies among the tokens
  evaluated).

A call is then `EngineCall(prompt tokens, tokens it evaluates, decode steps it takes, documents it
places)`, and
`EngineCosts.run_ms` replays the engine's loop over a list of calls sent `c` at a time, which gives
both a call's latency alone and the time per c calls at concurrency c: the T(c) the MILP reads, the
same curve the profiler measures for other components.

What the model assumes: a token's cost grows linearly with the positions before it; the calls a
deployment serves are like the recorded ones, each reusing what the recorded calls before it left
cached (a request's answer reuses the documents its grade evaluated) and nothing more: documents
that repeat across requests more often than in the calibration are reused more, and served faster,
than planned. `fit` takes the parameters from short calls, `check` measures how far the model is
from whole calls it did not see.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from patchkit.components.generators.llama.engine_turn import Reading, TurnSize
from patchkit.scheduler.offline.pwl import PiecewiseLinear

__all__ = [
    "BLEND_COUNTERS", "COUNTERS", "Counters", "EngineCall", "EngineCosts", "Replayed", "fit", "keys", "prompt_costs",
    "relative_error",
]

# The counters an engine's `stats()` reports that the model reads (LlamaCppGenerator's, since start).
COUNTERS = (
    "prompt_tokens_evaluated", "prompt_tokens_reused", "generated_tokens", "prefill_s", "decode_s",
    "decode_steps", "decoded_sequences",
)
# Counters of an engine that reuses documents at any position (kv_reuse="blend"), 0 when it reports none.
BLEND_COUNTERS = ("blend_tokens_reused", "blend_documents_reused", "blend_documents_evaluated", "blend_s")
DEFAULT_TURN = TurnSize()  # an engine that reports no sizes: 512 prompt tokens a turn, in slices of 64
SPREAD = 128  # positions the prompt runs' tokens must differ by, on average, to fit attention's cost apart


@dataclass(frozen=True)
class Counters:
    """How an engine's counters moved over one measured run."""

    prompt_tokens_evaluated: int
    prompt_tokens_reused: int
    generated_tokens: int
    prefill_s: float
    decode_s: float
    decode_steps: int
    decoded_sequences: int
    blend_tokens_reused: int = 0
    blend_documents_reused: int = 0
    blend_documents_evaluated: int = 0
    blend_s: float = 0.0

    @classmethod
    def between(cls, before: Mapping[str, Any], after: Mapping[str, Any]) -> Counters:
        """The change from `before` to `after`, two readings of the engine's `stats()`.

        A ValueError names the counters missing: an engine that opts into the cost model must report them."""
        missing = [name for name in COUNTERS if name not in before or name not in after]
        if missing:
            raise ValueError(f"the engine's stats() lacks {', '.join(missing)}: the cost model reads them")
        change = {name: after[name] - before[name] for name in COUNTERS}
        change.update({name: after.get(name, 0) - before.get(name, 0) for name in BLEND_COUNTERS})
        ints = {name: int(value) for name, value in change.items() if not name.endswith("_s")}
        return cls(**{**change, **ints})

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_tokens_evaluated + self.prompt_tokens_reused + self.blend_tokens_reused

    @property
    def placed(self) -> int:
        """Documents whose cells were placed into prompts (under blend; not those evaluated in place, on
        their first sight)."""
        return self.blend_documents_reused + self.blend_documents_evaluated

    @property
    def engine_ms(self) -> float:
        """Milliseconds the engine spent evaluating: prompts and decode steps."""
        return (self.prefill_s + self.decode_s) * 1000


@dataclass(frozen=True)
class EngineCall:
    """One call as the engine runs it: its prompt's tokens, how many of them it evaluates (the rest
    reused from the engine's cache), the decode steps its answer takes after the prompt, and the
    documents whose cells it places (under blend: their tokens are neither evaluated nor a prefix)."""

    prompt_tokens: int
    evaluated: int
    steps: int
    placed: int = 0

    def to_list(self) -> list[int]:
        return [self.prompt_tokens, self.evaluated, self.steps, self.placed]


@dataclass
class Replayed:
    """A replay of the engine's loop: its milliseconds, and the prompt chunks (llama_decode calls of
    prompt tokens), decode steps and sequences in them, the steps that waited behind prompt chunks in
    their turn and the most prompt tokens one waited behind, as `LlamaEngine.stats` counts them."""

    ms: float = 0.0
    prompt_chunks: int = 0
    decode_steps: int = 0
    decoded_sequences: int = 0
    mixed_steps: int = 0
    step_prompt_tokens_max: int = 0


@dataclass
class _Running:
    """A call in the replayed engine: the prompt tokens its KV state holds, the decode steps left. A call
    that evaluates more tokens than its prompt has (under blend, documents evaluated alone first)
    starts before position 0: its chunks then count every token it evaluates."""

    call: EngineCall
    position: int
    steps: int


@dataclass(frozen=True)
class EngineCosts:
    """One engine replica's costs at its thread count; see the module's docstring."""

    prompt_ms_per_token: float
    step: PiecewiseLinear  # ms of one decode step, by the sequences in it
    call_ms: float
    turn: TurnSize = DEFAULT_TURN  # as the engine reports it
    place_ms: float = 0.0  # placing one document's cells, under blend
    key_ms: float = 0.0  # attention: a token's ms per position before it (its prompt's, or its answer's so far)
    step_context: float = 0.0  # the mean context of the sequences in the runs `step` was fitted on

    def latency_ms(self, call: EngineCall) -> float:
        """One call's milliseconds when it runs alone."""
        start = call.prompt_tokens - call.evaluated
        prompt = self.chunk_ms(start, call.prompt_tokens) + call.placed * self.place_ms
        contexts = call.steps * (call.prompt_tokens - self.step_context) + call.steps * (call.steps - 1) / 2
        return self.call_ms + prompt + max(call.steps * self.step(1) + self.key_ms * contexts, 0.0)

    def chunk_ms(self, start: int, end: int) -> float:
        """Evaluating prompt tokens [start, end) of one sequence: their ms each, and each one's attention
        over the positions before it."""
        return (end - start) * self.prompt_ms_per_token + self.key_ms * keys(start, end)

    def step_ms(self, contexts: Sequence[int]) -> float:
        """One decode step of sequences whose contexts (prompt and answer so far) are `contexts`: the
        fitted step at their number, with its attention moved by how far their contexts are from those
        it was fitted on (never under a tenth of it)."""
        fitted = self.step(len(contexts))
        return max(fitted + self.key_ms * (sum(contexts) - len(contexts) * self.step_context), 0.1 * fitted)

    def run_ms(self, calls: Sequence[EngineCall], concurrency: int) -> float:
        """Milliseconds until every call is answered, sent in order `concurrency` at a time, the next
        as one is answered: the engine's loop replayed turn by turn (see the module's docstring)."""
        return self.replay(calls, concurrency).ms

    def replay(self, calls: Sequence[EngineCall], concurrency: int) -> Replayed:
        """`run_ms`'s replay of the engine's loop, with what it counted as the engine's stats count it."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1; got {concurrency}")
        arrivals = [(self.call_ms, i) for i in range(min(concurrency, len(calls)))]  # (ms it reaches the engine, call)
        heapq.heapify(arrivals)
        sent, replayed = len(arrivals), Replayed()
        running: list[_Running] = []  # in the order admitted
        while arrivals or running:
            if not running and arrivals[0][0] > replayed.ms:
                replayed.ms = arrivals[0][0]
            while arrivals and arrivals[0][0] <= replayed.ms:
                call = calls[heapq.heappop(arrivals)[1]]
                running.append(_Running(call, call.prompt_tokens - call.evaluated, call.steps))
            done = self._turn(running, replayed)
            for _ in range(done):
                if sent < len(calls):
                    heapq.heappush(arrivals, (replayed.ms + self.call_ms, sent))
                    sent += 1
        return replayed

    def _turn(self, running: list[_Running], replayed: Replayed) -> int:
        """One turn over the running sequences (changed in place): the prompt chunks the engine's turn
        takes (`TurnSize.prompt_chunks`), then a decode step, counted into `replayed`. A call's evaluated
        tokens are taken as its prompt's last ones, its documents placed before them. Returns how many
        calls it finished."""
        before = len(running)
        reading = [s for s in running if s.position < s.call.prompt_tokens]
        contexts = self._contexts([s for s in running if s.position == s.call.prompt_tokens and s.steps > 0])
        step_ms = self.step_ms(contexts) if contexts else None
        budget = self.turn.budget(len(contexts), step_ms, self.prompt_ms_per_token)
        evaluated = 0
        for chunk in self.turn.prompt_chunks([Reading(s.position, s.call.prompt_tokens) for s in reading], budget):
            sequence = reading[chunk.sequence]
            if sequence.position == sequence.call.prompt_tokens - sequence.call.evaluated:
                replayed.ms += sequence.call.placed * self.place_ms
            replayed.ms += self.chunk_ms(chunk.start, chunk.end)
            replayed.prompt_chunks += 1
            evaluated += chunk.end - chunk.start
            sequence.position = chunk.end
        if contexts and evaluated:
            replayed.mixed_steps += 1
            replayed.step_prompt_tokens_max = max(replayed.step_prompt_tokens_max, evaluated)
        decoding = [s for s in running if s.position == s.call.prompt_tokens and s.steps > 0]
        if decoding:
            replayed.ms += self.step_ms(self._contexts(decoding))
            replayed.decode_steps += 1
            replayed.decoded_sequences += len(decoding)
            for sequence in decoding:
                sequence.steps -= 1
        running[:] = [s for s in running if s.position < s.call.prompt_tokens or s.steps > 0]
        return before - len(running)

    @staticmethod
    def _contexts(decoding: Sequence[_Running]) -> list[int]:
        """The contexts (prompt and answer so far) of the sequences in a decode step."""
        return [s.call.prompt_tokens + s.call.steps - s.steps for s in decoding]

    def curve(self, calls: Sequence[EngineCall], levels: Sequence[int]) -> tuple[tuple[int, float], ...]:
        """(c, ms per c calls) at each concurrency level c: calls like `calls`, c in flight, in a
        stream long enough that filling and draining the engine weigh little."""
        points = []
        for level in levels:
            rounds = math.ceil(max(8 * level, 2 * len(calls)) / len(calls))
            stream = [*calls] * rounds
            points.append((level, self.run_ms(stream, level) * level / len(stream)))
        return tuple(points)

    def describe(self) -> dict[str, Any]:
        """The fitted parameters, JSON-able: prompt tokens/s, decode step ms by sequences, ms per call."""
        return {
            "prompt_tokens_per_s": 1000 / self.prompt_ms_per_token if self.prompt_ms_per_token else math.inf,
            "step_ms": [[k, ms] for k, ms in zip(self.step.breakpoints, self.step.values)],
            "call_ms": self.call_ms,
            "prompt_tokens_per_turn": self.turn.prompt_tokens,
            "slice": self.turn.slice,
            "step_interval": self.turn.interval,
            "place_ms": self.place_ms,
            "key_ms": self.key_ms,
            "step_context": self.step_context,
        }

    @classmethod
    def from_description(cls, data: Mapping[str, Any]) -> EngineCosts:
        """The inverse of `describe()`: how a cached profile's model is read back."""
        step = PiecewiseLinear(tuple(float(k) for k, _ in data["step_ms"]), tuple(float(ms) for _, ms in data["step_ms"]))
        rate = float(data["prompt_tokens_per_s"])
        turn = TurnSize(int(data["prompt_tokens_per_turn"]), int(data.get("slice", data.get("block", 64))),
                        float(data.get("step_interval", math.inf)))
        return cls(1000 / rate, step, float(data["call_ms"]), turn, float(data["place_ms"]), float(data.get("key_ms", 0.0)),
                   float(data.get("step_context", 0.0)))


def fit(
    prompts: Sequence[tuple[Counters, float]],
    steps: Sequence[tuple[Counters, float]],
    *,
    turn: TurnSize = DEFAULT_TURN,
    step_context: float = 0.0,
) -> EngineCosts:
    """The costs from short calls, each run given with its counters and the milliseconds it took end to
    end: `prompts`, calls run one at a time that evaluate their prompts and decode little or nothing;
    `steps`, runs of k calls sent at once that decode a few tokens each. Called by the profiler once
    per thread count.

    A decode step costs what its run took beyond the calls' prompts and their cost beyond the engine,
    per step, at the run's mean sequences per step: more than the engine's own decode time, since
    sampling each sequence's token and handing it over count too (never less). Runs without a decode
    step (calls limited to one token) leave steps at 0 ms. `turn`: the sizes the engine reports. A
    document placed (under blend) costs what placing took, per document, in the prompt runs.

    A token's attention reads every position before it, so a prompt token costs more the later it
    sits: where the prompt runs evaluated tokens at positions far enough apart, their ms are split
    into ms a token and ms a position before it (`key_ms`, `prompt_costs`), and a decode step's ms
    move with its sequences' contexts by the same `key_ms`, from `step_context`, the mean context of
    the sequences of the `steps` runs.
    """
    evaluated = sum(c.prompt_tokens_evaluated for c, _ in prompts)
    if not prompts or evaluated == 0:
        raise ValueError("the cost model needs at least one call that evaluated prompt tokens")
    prompt_ms, key_ms = prompt_costs(prompts)
    call_ms = max(statistics.median(ms - c.engine_ms - c.blend_s * 1000 for c, ms in prompts), 0.0)
    placed = sum(c.placed for c, _ in prompts)
    place_ms = sum(c.blend_s for c, _ in prompts) * 1000 / placed if placed else 0.0
    points = [
        (c.decoded_sequences / c.decode_steps,
         max(c.decode_s * 1000, ms - call_ms - (c.prefill_s + c.blend_s) * 1000) / c.decode_steps)
        for c, ms in steps if c.decode_steps
    ]
    # No decode step in any run: the calls answer in the token their prompt gives, and steps cost nothing of theirs.
    step = PiecewiseLinear.fit(points) if points else PiecewiseLinear((1.0,), (0.0,))
    return EngineCosts(prompt_ms, step, call_ms, turn, place_ms, key_ms, step_context)


def keys(start: int, end: int) -> float:
    """Positions before each of the tokens [start, end) of a sequence, summed: what their attention reads."""
    return (end - start) * (start + end - 1) / 2


def prompt_costs(prompts: Sequence[tuple[Counters, float]]) -> tuple[float, float]:
    """(ms a prompt token, ms a position before it) from runs that evaluated prompts: a least-squares fit
    of their prefill ms, each run's evaluated tokens taken as its prompt's last. Where the runs' tokens
    sit within `SPREAD` positions of each other on average, or the fit is not positive, the second is 0
    and the first their mean."""
    runs = [(c.prompt_tokens_evaluated, keys(c.prompt_tokens - c.prompt_tokens_evaluated, c.prompt_tokens),
             c.prefill_s * 1000) for c, _ in prompts if c.prompt_tokens_evaluated > 0]
    mean = sum(ms for *_, ms in runs) / sum(n for n, *_ in runs)
    places = [k / n for n, k, _ in runs]
    if len(runs) < 2 or max(places) - min(places) < SPREAD:
        return mean, 0.0
    nn, nk, kk = (sum(n * n for n, _, _ in runs), sum(n * k for n, k, _ in runs), sum(k * k for _, k, _ in runs))
    ny, ky = sum(n * ms for n, _, ms in runs), sum(k * ms for _, k, ms in runs)
    determinant = nn * kk - nk * nk
    if determinant <= 0:
        return mean, 0.0
    per_token, per_key = (ny * kk - ky * nk) / determinant, (nn * ky - nk * ny) / determinant
    return (per_token, per_key) if per_token > 0 and per_key >= 0 else (mean, 0.0)


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured: how far the model is from a measured run."""
    return abs(predicted - measured) / measured if measured > 0 else math.inf
