"""Profiling an engine that batches by itself through its cost model: short calls fit it, whole calls check it.

An engine opts in with a `max_concurrency` method, counters in its `stats()` (`costmodel.COUNTERS`),
and `profile_call(method, call, max_tokens)`: the same recorded call answering at most `max_tokens`
tokens. `LlamaCppGenerator` does. Its replica, at one thread count, then runs (in this order, so
that each step finds the engine's cache as it needs it):

1. prompts: each distinct recorded call once, one at a time, answering 1 token, from a cold engine:
   the prompt evaluation rate, the cost of a call beyond the engine, and how many of each call's
   prompt tokens the engine evaluates when the calls come in their recorded order (the rest reused);
2. whole calls, one at a time, their prompts now cached: how many decode steps each answer takes,
   and the first check (their time is not fitted on);
3. decode steps: k copies of one call at once answering `STEP_TOKENS` tokens, for k in
   `STEP_LEVELS`: a step's ms at k sequences;
4. the second check: `CHECK_CONCURRENCY` whole calls at once (the calls step 1 ran, cycled), against
   the model fitted on 1 and 3.

The distinct calls' token counts do not depend on the thread count: at further thread counts they
are taken from the first one, step 1 evaluates only `PROMPT_TOKENS_AGAIN` tokens (the call step 3
uses first) and step 2 is left out; and when step 1 finds prompts evaluated no faster than with
fewer threads (by the profiler's threshold), the profile stops there. The T(c) curve the MILP reads
is predicted for the calls as step 1 found them, at each concurrency level: see `costmodel` for
what the model assumes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from patchkit.components.generators.llama.engine_turn import TurnSize
from patchkit.core import Call, Component
from patchkit.errors import PlanError
from patchkit.orchestrator.backend import Replica
from patchkit.scheduler.offline.costmodel import Counters, EngineCall, EngineCosts, fit, relative_error
from patchkit.scheduler.offline.profiles import MethodProfile
from patchkit.scheduler.offline.runs import check_outcomes, stats, timed

__all__ = ["EngineProfile", "Workload", "opts_in"]

STEP_TOKENS = 16  # tokens each decode-step call answers
STEP_LEVELS = (1, 3, 8)  # calls at once whose decode steps are timed (up to the method's max_concurrency)
CHECK_CONCURRENCY = 8  # whole calls at once in the check
PROMPT_TOKENS_AGAIN = 512  # prompt tokens evaluated to fit the rate at a further thread count
MODEL_CALLS = 16  # distinct recorded calls the model is built from: the first ones
LEVELS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # concurrency levels of the predicted curve


def opts_in(component: Component, concurrency: int | None) -> bool:
    """Whether a method with this `max_concurrency` on `component` is profiled through the cost model."""
    return concurrency is not None and callable(getattr(component, "profile_call", None))


def levels(concurrency: int) -> list[int]:
    """The concurrency levels of the curve: `LEVELS` up to `concurrency`, and `concurrency` itself."""
    return sorted({level for level in LEVELS if level < concurrency} | {concurrency})


@dataclass(frozen=True)
class Workload:
    """The distinct recorded calls as the engine runs them: `cold`, in their recorded order from an
    engine that cached nothing before (what the curve is predicted for), and `warm`, run again with
    their prompts cached (what the check runs). The same at every thread count."""

    cold: tuple[EngineCall, ...]
    warm: tuple[EngineCall, ...]

    def stepper(self) -> int:
        """The call the decode steps are timed with: one whose answer lasts the `STEP_TOKENS` (so that its k
        copies step together throughout) and whose prompt is nearest the length the answers decode over,
        on average (a step reads every sequence's prompt: its cost grows with their lengths); of those
        alike, the one the engine evaluates least of again when it has it cached (a prompt is reused up
        to a block boundary: the rest is evaluated again)."""
        steps = sum(c.steps for c in self.warm) or 1
        context = sum(c.steps * c.prompt_tokens for c in self.warm) / steps
        return min(range(len(self.warm)), key=lambda i: (
            -min(self.warm[i].steps, STEP_TOKENS - 1), abs(self.warm[i].prompt_tokens - context), self.warm[i].evaluated))

    @classmethod
    def measured(cls, prompts: Sequence[tuple[Counters, float]], whole: Sequence[tuple[Counters, float]]) -> Workload:
        """From steps 1 and 2: each call's counters from a cold engine, then run whole with its prompt cached."""
        warm = tuple(EngineCall(c.prompt_tokens, c.prompt_tokens_evaluated, c.decode_steps, c.placed) for c, _ in whole)
        cold = tuple(EngineCall(w.prompt_tokens, c.prompt_tokens_evaluated, w.steps, c.placed)
                     for (c, _), w in zip(prompts, warm))
        return cls(cold, warm)

    @classmethod
    def from_model(cls, model: Mapping[str, Any]) -> Workload:
        """The workload a profile's `model` was built from (`MethodProfile.model`)."""
        return cls(tuple(EngineCall(*c) for c in model["calls"]), tuple(EngineCall(*c) for c in model["warm"]))


class EngineProfile:
    """One engine method on one replica (one thread count): fit, check, curve. See the module's docstring."""

    def __init__(
        self, replica: Replica, name: str, component: Any, method: str, calls: Sequence[Call], concurrency: int,
        note: Callable[[str], None],
    ) -> None:
        """`component`: the user's object (its `profile_call` shortens calls here); `calls`: the distinct
        recorded calls, in order; `note`: shows the step under way."""
        self.replica, self.name, self.component, self.method = replica, name, component, method
        self.calls, self.concurrency, self.note = list(calls)[:MODEL_CALLS], concurrency, note
        self.turn = TurnSize()  # the engine's, as its stats report it (read at the first run)

    async def run(self, fewer: MethodProfile | None = None, threshold: float = 0.1) -> MethodProfile:
        """Measure and predict. `fewer`: this method's profile at the previous thread count (None at the first),
        whose workload is reused; when prompts are not evaluated `threshold` faster than there, the
        profile stops after step 1 (see `_no_faster`)."""
        known = Workload.from_model(fewer.model) if fewer is not None and fewer.model is not None else None
        evaluated = await self._prompts(known)
        prompts = list(evaluated.values())
        if fewer is not None and (slower := _no_faster(prompts, fewer, threshold)) is not None:
            return slower
        whole = await self._one_at_a_time() if known is None else []
        known = known or Workload.measured(prompts, whole)
        steps = [await self._steps(self.calls[known.stepper()], k) for k in STEP_LEVELS if k <= self.concurrency]
        try:
            stepper = known.warm[known.stepper()]
            context = stepper.prompt_tokens + min(stepper.steps + 1, STEP_TOKENS) / 2  # a step's sequences, on average
            costs = fit(prompts, steps, turn=self.turn, step_context=context)
        except ValueError as exc:
            raise PlanError(f"{self.name}.{self.method}: {exc}") from None
        checks = await self._checks(costs, known, whole, sorted(evaluated))
        errors = {what: relative_error(*check) for what, check in checks.items()}
        model = {
            "costs": costs.describe(), "error": max(errors.values()), "errors": errors,
            "checks": {what: {"predicted_ms": p, "measured_ms": m} for what, (p, m) in checks.items()},
            "calls": [c.to_list() for c in known.cold], "warm": [c.to_list() for c in known.warm],
        }
        return MethodProfile(self.method, costs.curve(known.cold, levels(self.concurrency)), self.concurrency, model)

    async def _checks(
        self, costs: EngineCosts, known: Workload, whole: list[tuple[Counters, float]], cached: list[int]
    ) -> dict[str, tuple[float, float]]:
        """The model's predictions against measured whole calls: `whole`, run one at a time (if any), and
        step 4's run of the calls whose prompts the engine has `cached`; (predicted ms, measured ms) by
        what was run."""
        checks = {}
        if whole:
            checks["one at a time"] = (sum(costs.latency_ms(call) for call in known.warm), sum(ms for _, ms in whole))
        level = min(self.concurrency, CHECK_CONCURRENCY)
        chosen = [cached[i % len(cached)] for i in range(level)]
        measured = await self._at_once(chosen)
        checks[f"{level} at once"] = (costs.run_ms([known.warm[i] for i in chosen], level), measured)
        return checks

    async def _prompts(self, known: Workload | None) -> dict[int, tuple[Counters, float]]:
        """Step 1: calls answering one token, one at a time: their counters and ms, by call. Every call, in
        order; or, when the workload is `known`, the call the decode steps are timed with first (its
        prompt is then cached for them), and others until `PROMPT_TOKENS_AGAIN` prompt tokens are evaluated."""
        order = list(range(len(self.calls)))
        if known is not None:
            order.insert(0, order.pop(known.stepper()))
        found: dict[int, tuple[Counters, float]] = {}
        for i in order:
            if known is not None and sum(c.prompt_tokens_evaluated for c, _ in found.values()) >= PROMPT_TOKENS_AGAIN:
                break
            self.note(f"{self.name}.{self.method}: prompt evaluation, call {len(found) + 1} of {len(self.calls)}")
            found[i] = await self._measure([self._short(self.calls[i], 1)], 1, "evaluating prompts")
        return found

    async def _steps(self, call: Call, k: int) -> tuple[Counters, float]:
        """Step 3: k copies of `call` at once, answering `STEP_TOKENS` tokens each."""
        self.note(f"{self.name}.{self.method}: decode steps, {k} calls at once")
        return await self._measure([self._short(call, STEP_TOKENS)] * k, k, f"decoding at {k} calls at once")

    async def _one_at_a_time(self) -> list[tuple[Counters, float]]:
        """Step 2: each call whole, one at a time."""
        found = []
        for i, call in enumerate(self.calls):
            self.note(f"{self.name}.{self.method}: checking, whole call {i + 1} of {len(self.calls)}")
            found.append(await self._measure([call], 1, "running whole calls"))
        return found

    async def _at_once(self, chosen: list[int]) -> float:
        """Step 4: the `chosen` calls whole, all at once: their ms."""
        self.note(f"{self.name}.{self.method}: checking, {len(chosen)} whole calls at once")
        batch = [self.calls[i] for i in chosen]
        return (await self._measure(batch, len(batch), f"running {len(batch)} whole calls at once"))[1]

    async def _measure(self, calls: list[Call], at_once: int, what: str) -> tuple[Counters, float]:
        before = await stats(self.replica)
        self.turn = TurnSize.reported(before)
        elapsed, outcomes = await timed(self.replica, self.method, calls, at_once, concurrent=True)
        if check_outcomes(self.name, self.method, outcomes, what) is not None:
            raise PlanError(f"{self.name}.{self.method} ran out of memory while {what}")
        try:
            return Counters.between(before, await stats(self.replica)), elapsed
        except ValueError as exc:
            raise PlanError(f"{self.name}.{self.method}: {exc}") from None

    def _short(self, call: Call, max_tokens: int) -> Call:
        shortened: Call = self.component.profile_call(self.method, call, max_tokens)
        return shortened


def _no_faster(prompts: Sequence[tuple[Counters, float]], fewer: MethodProfile, threshold: float) -> MethodProfile | None:
    """At more threads, prompts evaluated less than `threshold` faster than at the previous count mean the
    engine does not pay for them (prompt evaluation is the most parallel part of its work, and most of
    it): the profile stops there, as the previous count's curve slowed by the prompt rates' ratio (which
    the profiler then rejects). None when prompts are evaluated faster. The rates compared are on the
    same tokens: these, as the previous count's model predicts them (at their positions)."""
    assert fewer.model is not None
    evaluated = sum(c.prompt_tokens_evaluated for c, _ in prompts)
    seconds = max(sum(c.prefill_s for c, _ in prompts), 1e-9)
    costs = EngineCosts.from_description(fewer.model["costs"])
    predicted = sum(costs.chunk_ms(c.prompt_tokens - c.prompt_tokens_evaluated, c.prompt_tokens) for c, _ in prompts) / 1000
    rate, before = evaluated / seconds, evaluated / max(predicted, 1e-9)
    if rate >= before * (1 + threshold):
        return None
    slower = before / rate
    points = tuple((c, ms * slower) for c, ms in fewer.points)
    stopped = f"prompts evaluated at {rate:.0f} tokens/s, {before:.0f} with fewer threads: profiled no further"
    return MethodProfile(fewer.method, points, fewer.max_batch, {"stopped": stopped, "prompt_tokens_per_s": rate})
