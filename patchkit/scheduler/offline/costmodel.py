"""The cost model of an engine that batches by itself: what a call costs from its token counts.

An engine such as `LlamaEngine` runs many sequences in one context, turn after turn: it evaluates up
to `prompt_tokens_per_turn` prompt tokens of the sequences still reading their prompts (oldest
first), then decodes one token for every sequence past its prompt in a single step. Its costs are
then three numbers and a curve, per thread count:

- `prompt_ms_per_token`: prompt evaluation is compute-bound, one sequence at a time, so it costs the
  same per token whatever runs beside it;
- `step`: one decode step's milliseconds by the sequences in it (a `PiecewiseLinear`): batching
  shares the weights' reads between sequences, so a step of 8 costs far less than 8 steps of 1;
- `call_ms`: what a call costs beyond the engine's evaluation (the process hop, the chat template,
  tokenizing, sampling).

A call is then `EngineCall(prompt tokens, tokens it evaluates, decode steps it takes)`, and
`EngineCosts.run_ms` replays the engine's loop over a list of calls sent `c` at a time, which gives
both a call's latency alone and the time per c calls at concurrency c: the T(c) the MILP reads, the
same curve the profiler measures for other components.

What the model assumes: prompt evaluation costs the same per token at every position (attention
over a longer prefix costs a little more; at a few hundred tokens this is within the check's
error); the calls a deployment serves are like the recorded ones, each reusing what the recorded
calls before it left cached (a request's answer reuses the documents its grade evaluated) and
nothing more: documents that repeat across requests more often than in the calibration are reused
more, and served faster, than planned. `fit` takes the parameters from short calls, `check` measures
how far the model is from whole calls it did not see.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from patchkit.scheduler.offline.pwl import PiecewiseLinear

__all__ = ["COUNTERS", "Counters", "EngineCall", "EngineCosts", "fit", "relative_error"]

# The counters an engine's `stats()` reports that the model reads (LlamaCppGenerator's, since start).
COUNTERS = (
    "prompt_tokens_evaluated", "prompt_tokens_reused", "generated_tokens", "prefill_s", "decode_s",
    "decode_steps", "decoded_sequences",
)
PROMPT_TOKENS_PER_TURN = 512  # an engine that does not say evaluates up to this many prompt tokens a turn


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

    @classmethod
    def between(cls, before: Mapping[str, Any], after: Mapping[str, Any]) -> Counters:
        """The change from `before` to `after`, two readings of the engine's `stats()`.

        A ValueError names the counters missing: an engine that opts into the cost model must report them."""
        missing = [name for name in COUNTERS if name not in before or name not in after]
        if missing:
            raise ValueError(f"the engine's stats() lacks {', '.join(missing)}: the cost model reads them")
        change = {name: after[name] - before[name] for name in COUNTERS}
        ints = {name: int(value) for name, value in change.items() if not name.endswith("_s")}
        return cls(**{**change, **ints})

    @property
    def prompt_tokens(self) -> int:
        return self.prompt_tokens_evaluated + self.prompt_tokens_reused

    @property
    def engine_ms(self) -> float:
        """Milliseconds the engine spent evaluating: prompts and decode steps."""
        return (self.prefill_s + self.decode_s) * 1000


@dataclass(frozen=True)
class EngineCall:
    """One call as the engine runs it: its prompt's tokens, how many of them it evaluates (the rest
    reused from the engine's cache), and the decode steps its answer takes after the prompt."""

    prompt_tokens: int
    evaluated: int
    steps: int

    def to_list(self) -> list[int]:
        return [self.prompt_tokens, self.evaluated, self.steps]


@dataclass(frozen=True)
class EngineCosts:
    """One engine replica's costs at its thread count; see the module's docstring."""

    prompt_ms_per_token: float
    step: PiecewiseLinear  # ms of one decode step, by the sequences in it
    call_ms: float
    prompt_tokens_per_turn: int = PROMPT_TOKENS_PER_TURN

    def latency_ms(self, call: EngineCall) -> float:
        """One call's milliseconds when it runs alone."""
        return self.call_ms + call.evaluated * self.prompt_ms_per_token + call.steps * self.step(1)

    def run_ms(self, calls: Sequence[EngineCall], concurrency: int) -> float:
        """Milliseconds until every call is answered, sent in order `concurrency` at a time, the next
        as one is answered: the engine's loop replayed turn by turn (see the module's docstring)."""
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1; got {concurrency}")
        arrivals = [(self.call_ms, i) for i in range(min(concurrency, len(calls)))]  # (ms it reaches the engine, call)
        heapq.heapify(arrivals)
        sent, now = len(arrivals), 0.0
        running: list[list[int]] = []  # [call, prompt tokens left, decode steps left], in the order admitted
        while arrivals or running:
            if not running and arrivals[0][0] > now:
                now = arrivals[0][0]
            while arrivals and arrivals[0][0] <= now:
                i = heapq.heappop(arrivals)[1]
                running.append([i, calls[i].evaluated, calls[i].steps])
            now, done = self._turn(running, now)
            for _ in range(done):
                if sent < len(calls):
                    heapq.heappush(arrivals, (now + self.call_ms, sent))
                    sent += 1
        return now

    def _turn(self, running: list[list[int]], now: float) -> tuple[float, int]:
        """One turn over the running sequences (changed in place): prompt tokens, then a decode step.
        Returns the time after it and how many calls it finished."""
        budget, before = self.prompt_tokens_per_turn, len(running)
        for sequence in running:
            if budget <= 0:
                break
            if sequence[1] > 0:
                take = min(budget, sequence[1])
                now += take * self.prompt_ms_per_token
                budget -= take
                sequence[1] -= take
        decoding = [s for s in running if s[1] == 0 and s[2] > 0]
        if decoding:
            now += self.step(len(decoding))
            for sequence in decoding:
                sequence[2] -= 1
        running[:] = [s for s in running if s[1] > 0 or s[2] > 0]
        return now, before - len(running)

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
            "prompt_tokens_per_turn": self.prompt_tokens_per_turn,
        }

    @classmethod
    def from_description(cls, data: Mapping[str, Any]) -> EngineCosts:
        """The inverse of `describe()`: how a cached profile's model is read back."""
        step = PiecewiseLinear(tuple(float(k) for k, _ in data["step_ms"]), tuple(float(ms) for _, ms in data["step_ms"]))
        rate = float(data["prompt_tokens_per_s"])
        return cls(1000 / rate, step, float(data["call_ms"]), int(data["prompt_tokens_per_turn"]))


def fit(
    prompts: Sequence[tuple[Counters, float]],
    steps: Sequence[tuple[Counters, float]],
    *,
    prompt_tokens_per_turn: int = PROMPT_TOKENS_PER_TURN,
) -> EngineCosts:
    """The costs from short calls, each run given with its counters and the milliseconds it took end to
    end: `prompts`, calls run one at a time that evaluate their prompts and decode little or nothing;
    `steps`, runs of k calls sent at once that decode a few tokens each. Called by the profiler once
    per thread count.

    A decode step costs what its run took beyond the calls' prompts and their cost beyond the engine,
    per step, at the run's mean sequences per step: more than the engine's own decode time, since
    sampling each sequence's token and handing it over count too (never less). Runs without a decode
    step (calls limited to one token) leave steps at 0 ms.
    """
    evaluated = sum(c.prompt_tokens_evaluated for c, _ in prompts)
    if not prompts or evaluated == 0:
        raise ValueError("the cost model needs at least one call that evaluated prompt tokens")
    prompt_ms = sum(c.prefill_s for c, _ in prompts) * 1000 / evaluated
    call_ms = max(statistics.median(ms - c.engine_ms for c, ms in prompts), 0.0)
    points = [
        (c.decoded_sequences / c.decode_steps, max(c.decode_s * 1000, ms - call_ms - c.prefill_s * 1000) / c.decode_steps)
        for c, ms in steps if c.decode_steps
    ]
    # No decode step in any run: the calls answer in the token their prompt gives, and steps cost nothing of theirs.
    step = PiecewiseLinear.fit(points) if points else PiecewiseLinear((1.0,), (0.0,))
    return EngineCosts(prompt_ms, step, call_ms, prompt_tokens_per_turn)


def relative_error(predicted: float, measured: float) -> float:
    """|predicted - measured| / measured: how far the model is from a measured run."""
    return abs(predicted - measured) / measured if measured > 0 else math.inf
