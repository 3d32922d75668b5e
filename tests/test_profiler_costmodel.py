"""The cost model of an engine that batches by itself: fitted from short calls, checked against whole calls.

`SleepingEngine` is an engine of known costs (it sleeps them): prompt tokens at PROMPT_MS each, one
sequence at a time, and decode steps of STEP_MS(k) for k sequences, with a prefix cache. Profiled
in a worker, the model must find those costs and predict its whole calls; on SmolLM2 it must
predict whole calls it did not fit on.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import patchkit
from patchkit import Component, make
from patchkit.components import LlamaCppGenerator
from patchkit.components.generators.llama.engine_turn import Chunk, Rates, Reading, Skip, Threads, TurnSize
from patchkit.orchestrator.resources import available_cpus
from patchkit.scheduler.offline.costmodel import Counters, EngineCall, EngineCosts, fit, keys
from patchkit.scheduler.offline.pool import ResourcePool
from patchkit.scheduler.offline.profiler import Profiler
from patchkit.scheduler.offline.pwl import PiecewiseLinear

PROMPT_MS = 1.0  # per prompt token
BLOCK = 8  # prompt tokens the engine's prefix cache reuses in


def step_ms(k: int) -> float:
    return 10.0 + 3.0 * k


@pytest.fixture(autouse=True)
def profile_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path))
    return tmp_path / "profiles"


# -- the model on synthetic timings, no engine ---------------------------------------------------------


def counters(evaluated: int = 0, steps: int = 0, sequences: int = 0, prefill_ms: float = 0.0, decode_ms: float = 0.0) -> Counters:
    return Counters(evaluated, 0, sequences, prefill_ms / 1000, decode_ms / 1000, steps, sequences)


def test_fit_finds_the_prompt_rate_the_cost_beyond_the_engine_and_the_decode_step_curve() -> None:
    prompts = [(counters(n, prefill_ms=n * 2.5), n * 2.5 + 7.0) for n in (100, 300, 50)]  # 7 ms a call outside the engine
    # k calls at once, 16 decode steps: the engine's decode time, and 0.5 ms a sequence a step to sample and hand over
    steps = [(counters(steps=16, sequences=16 * k, decode_ms=16 * step_ms(k)), 7.0 + 16 * (step_ms(k) + 0.5 * k))
             for k in (1, 4, 16)]
    costs = fit(prompts, steps)
    assert costs.prompt_ms_per_token == pytest.approx(2.5)
    assert costs.call_ms == pytest.approx(7.0)
    for k in (1, 2, 8, 16):
        assert costs.step(k) == pytest.approx(step_ms(k) + 0.5 * k)


def test_a_token_costs_more_the_more_positions_come_before_it_in_prompts_and_decode_steps() -> None:
    # Prompts at 2 ms a token and 0.01 ms a position before it: whole prompts from 0, and a tail after a cached prefix
    def run(start: int, end: int) -> tuple[Counters, float]:
        ms = (end - start) * 2.0 + 0.01 * keys(start, end)
        return Counters(end - start, start, 1, ms / 1000, 0.0, 0, 0), ms + 5.0
    prompts = [run(0, 600), run(576, 620), run(0, 750), run(700, 1400)]
    steps = [(counters(steps=16, sequences=16 * k, decode_ms=16 * step_ms(k)), 5.0 + 16 * step_ms(k)) for k in (1, 4)]
    costs = fit(prompts, steps, step_context=600.0)
    assert costs.prompt_ms_per_token == pytest.approx(2.0) and costs.key_ms == pytest.approx(0.01)
    tail, head = EngineCall(prompt_tokens=1400, evaluated=50, steps=0), EngineCall(prompt_tokens=50, evaluated=50, steps=0)
    assert costs.latency_ms(tail) - costs.latency_ms(head) == pytest.approx(0.01 * 50 * 1350)
    # a step of sequences with longer contexts than those the steps were fitted on costs their attention more
    assert costs.step_ms([1600, 600]) == pytest.approx(costs.step(2) + 0.01 * 1000)
    long, short = EngineCall(1400, 50, 10), EngineCall(1400, 50, 0)
    assert costs.latency_ms(long) - costs.latency_ms(short) == pytest.approx(10 * costs.step(1) + 0.01 * (10 * 800 + 45))
    assert costs.run_ms([long], 1) == pytest.approx(costs.latency_ms(long))
    assert EngineCosts.from_description(costs.describe()) == costs
    # prompts all near one place tell a token's cost from its position's apart no better than a mean
    near = fit([run(0, 100), run(0, 120)], steps)
    mean = (200 + 240 + 0.01 * (keys(0, 100) + keys(0, 120))) / 220
    assert near.key_ms == 0.0 and near.prompt_ms_per_token == pytest.approx(mean)


def test_a_call_alone_costs_its_prompt_its_steps_and_the_time_beyond_the_engine() -> None:
    costs = EngineCosts(2.0, PiecewiseLinear((1.0, 16.0), (10.0, 40.0)), 5.0)
    call = EngineCall(prompt_tokens=120, evaluated=100, steps=30)
    assert costs.latency_ms(call) == pytest.approx(5.0 + 200.0 + 30 * 10.0)
    assert costs.run_ms([call, call], 1) == pytest.approx(2 * costs.latency_ms(call))


def test_calls_at_once_share_decode_steps_and_queue_for_prompt_evaluation() -> None:
    costs = EngineCosts(1.0, PiecewiseLinear((1.0, 2.0), (10.0, 12.0)), 0.0)
    a, b = EngineCall(100, 100, 3), EngineCall(50, 50, 1)
    # one turn evaluates both prompts (150 ms), then a step of 2 (12 ms) ends b, two steps of 1 (20 ms) end a
    assert costs.run_ms([a, b], 2) == pytest.approx(150 + 12 + 20)
    # a turn evaluates at most its prompt tokens: b's prompt waits for a's first step; then they share one
    limited = EngineCosts(1.0, costs.step, 0.0, turn=TurnSize(100, slice=10))
    assert limited.run_ms([a, b], 2) == pytest.approx(100 + 10 + 50 + 12 + 10)
    # in blocks of 64 a turn of 100 starts no second block after a's first: a's prompt takes two turns
    blocks = EngineCosts(1.0, costs.step, 0.0, turn=TurnSize(100, slice=64))
    replayed = blocks.replay([a, b], 2)
    assert replayed.prompt_chunks == 3 and replayed.decode_steps == 3
    assert replayed.ms == pytest.approx(64 + 36 + 10 + 50 + 12 + 10)


def test_a_turn_splits_prompts_at_block_boundaries_oldest_first_within_its_tokens() -> None:
    turn = TurnSize(prompt_tokens=128, slice=64)
    # a prefix of 70 reused: up to the next boundary, then whole blocks; the second waits once under a block is left
    assert turn.prompt_chunks([Reading(70, 300), Reading(0, 50)]) == [Chunk(0, 70, 128), Chunk(0, 128, 192)]
    assert turn.prompt_chunks([Reading(0, 40), Reading(0, 50), Reading(0, 90)]) == [
        Chunk(0, 0, 40), Chunk(1, 0, 50)]  # 38 left: no chunk of the third starts
    assert turn.prompt_chunks([Reading(0, 40), Reading(0, 20)]) == [Chunk(0, 0, 40), Chunk(1, 0, 20)]
    # a document placed at [20, 60): its run skipped, its cost charged (at least 1), evaluation resumes after it
    placed, alone = Skip(20, 60, 0), Skip(20, 60, 50)  # alone: its body, from 10, evaluated first
    assert turn.prompt_chunks([Reading(0, 100, (placed,))]) == [Chunk(0, 0, 20), Chunk(0, 20, 60, placed),
                                                                Chunk(0, 60, 64), Chunk(0, 64, 100)]
    assert turn.prompt_chunks([Reading(0, 100, (alone,))]) == [Chunk(0, 0, 20), Chunk(0, 20, 60, alone)]
    assert TurnSize.reported({"prompt_tokens_per_turn": 256, "block": 32}) == TurnSize(256, 32)
    assert TurnSize.reported({}) == TurnSize()
    with pytest.raises(ValueError, match=r"slice \(64\) must be >= 1 and <= prompt_tokens \(32\)"):
        TurnSize(32, 64)


def test_a_turn_beside_decoding_sequences_evaluates_its_step_budget_in_whole_slices() -> None:
    turn = TurnSize(prompt_tokens=512, slice=16, interval=2.0)
    # nothing decoding: the whole turn; a decode step of 40 ms at 2 ms a prompt token: 20 tokens, one slice of 16
    assert turn.budget(0, None, None) == 512
    assert turn.budget(4, 40.0, 2.0) == 16
    assert turn.budget(8, 100.0, 2.0) == 48  # 50 tokens take one step: three whole slices
    assert turn.budget(8, 10.0, 2.0) == 16  # a step shorter than a slice still lets one slice through
    assert turn.budget(8, 10_000.0, 2.0) == 512  # never past the turn's tokens
    assert turn.budget(1, None, 2.0) == turn.budget(1, 40.0, None) == 16  # rates not measured yet: one slice
    assert TurnSize(512, 16, interval=3.0).budget(4, 40.0, 2.0) == 32  # two steps' worth
    assert TurnSize(512, 16).budget(4, 40.0, 2.0) == 512  # no interval: the old turn
    # the chunks within a budget: 16 tokens of the oldest, slice-aligned, then no more
    assert turn.prompt_chunks([Reading(0, 100), Reading(0, 50)], 16) == [Chunk(0, 0, 16)]
    assert turn.prompt_chunks([Reading(90, 100), Reading(0, 50)], 32) == [Chunk(0, 90, 96), Chunk(0, 96, 100),
                                                                          Chunk(1, 0, 16)]
    assert TurnSize.reported({"prompt_tokens_per_turn": 256, "slice": 16, "block": 64, "step_interval": 2.0}) == TurnSize(
        256, 16, 2.0)
    with pytest.raises(ValueError, match=r"interval \(0.5\) must be >= 1"):
        TurnSize(512, 16, interval=0.5)


def test_rates_follow_what_the_engine_measured_and_take_the_nearest_step_size() -> None:
    rates = Rates(weight=0.5)
    assert rates.step_of(3) is None and rates.prompt_ms_per_token is None
    rates.prompt(16, 32.0)
    rates.prompt(16, 64.0)
    assert rates.prompt_ms_per_token == pytest.approx(3.0)  # 2 ms, then halfway to 4
    rates.step(1, 10.0)
    rates.step(8, 40.0)
    assert (rates.step_of(1), rates.step_of(2), rates.step_of(6), rates.step_of(16)) == (10.0, 10.0, 40.0, 40.0)


def test_a_lone_engine_takes_the_threads_that_measured_fastest_and_tries_the_others_again() -> None:
    assert Threads.upto(1).counts == (1,) and Threads.upto(2).counts == (1, 2) and Threads.upto(6).counts == (1, 2, 4, 6)
    threads = Threads.upto(2)
    picked = []
    for _ in range(40):
        count = threads.next()
        picked.append(count)
        threads.ran(count, 16, 16 * (5.0 if count == 2 else 9.0))  # two threads nearly twice as fast: an idle machine
    assert picked[:2] == [1, 2]  # each count measured once first
    assert picked.count(1) == 1 + len(range(15, 40, 16))  # then two threads, one in 16 runs on one thread again
    assert set(picked[2:15]) == {2}
    # the machine gets busy: two threads now wait at barriers for a core another process holds
    for _ in range(60):
        count = threads.next()
        threads.ran(count, 16, 16 * (30.0 if count == 2 else 9.0))
    assert threads.next() == 1
    assert Threads.upto(1).next() == 1


def test_the_replay_interleaves_decode_steps_between_prompt_slices() -> None:
    # 1 ms a prompt token and decode steps of 20 ms: a budget of 16 tokens (one slice) while a sequence decodes
    costs = EngineCosts(1.0, PiecewiseLinear((1.0, 2.0), (20.0, 20.0)), 0.0, turn=TurnSize(512, slice=16, interval=2.0))
    decoder, reader = EngineCall(16, 16, 20), EngineCall(160, 160, 1)
    replayed = costs.replay([decoder, reader], 2)
    # turn 1: both prompts admitted, nothing decodes yet, so the whole turn reads both (16 + 160 tokens in 11 chunks);
    assert replayed.prompt_chunks == 11
    late = costs.replay([decoder, EngineCall(16, 16, 0), reader], 2)
    # the reader comes while the decoder decodes: its 160 tokens go one slice a turn, a decode step after each
    assert late.prompt_chunks == 2 + 10 and late.decode_steps == 20
    assert (late.mixed_steps, late.step_prompt_tokens_max) == (10, 16)
    whole = EngineCosts(1.0, costs.step, 0.0, turn=TurnSize(512, slice=16)).replay([decoder, EngineCall(16, 16, 0), reader], 2)
    # without an interval the reader's whole prompt goes in the turn after the first step: the same work, in other turns
    assert (whole.prompt_chunks, whole.decode_steps, whole.ms) == (12, 20, pytest.approx(late.ms))
    assert (whole.mixed_steps, whole.step_prompt_tokens_max) == (1, 160)


def test_a_placed_document_costs_its_placing_instead_of_its_tokens() -> None:
    placing = Counters(100, 0, 0, 0.1, 0.0, 0, 0, blend_tokens_reused=200, blend_documents_reused=4, blend_s=0.008)
    assert placing.prompt_tokens == 300 and placing.placed == 4
    costs = fit([(placing, 100 + 8 + 5.0)], [])
    assert costs.place_ms == pytest.approx(2.0) and costs.call_ms == pytest.approx(5.0)
    call = EngineCall(prompt_tokens=300, evaluated=100, steps=0, placed=4)
    assert costs.latency_ms(call) == pytest.approx(5.0 + 100 + 8) == costs.run_ms([call], 1)
    assert EngineCosts.from_description(costs.describe()) == costs


def test_the_curve_is_time_per_c_calls_and_batching_raises_calls_per_second() -> None:
    costs = EngineCosts(0.5, PiecewiseLinear((1.0, 16.0), (10.0, 25.0)), 2.0)
    calls = [EngineCall(200, 150, 40), EngineCall(220, 20, 60)]
    points = dict(costs.curve(calls, [1, 4, 16]))
    alone = (costs.latency_ms(calls[0]) + costs.latency_ms(calls[1])) / 2
    assert points[1] == pytest.approx(alone, rel=0.01)
    assert 16 / points[16] > 4 / points[4] > 1 / points[1]


def test_an_engine_without_the_counters_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="lacks prompt_tokens_reused, .*decode_s"):
        Counters.between({"prompt_tokens_evaluated": 1}, {"prompt_tokens_evaluated": 2})


# -- an engine of known costs, profiled in a worker ---------------------------------------------------------


class _Sequence:
    def __init__(self, evaluate: int, answer: int) -> None:
        self.evaluate, self.answer, self.made = evaluate, answer, 0
        self.done = threading.Event()


class SleepingEngine(Component):
    """Continuous batching that sleeps its costs: a turn evaluates waiting prompts (PROMPT_MS a token,
    less the prefix a cached prompt shares, in blocks of BLOCK), then a decode step of STEP_MS(k) ms for
    the k sequences past their prompts. `generate("w1 w2 ... / n")` answers n tokens."""

    def setup(self) -> None:
        self.lock = threading.Condition()
        self.running: list[_Sequence] = []
        self.cached: list[list[str]] = []
        self.counts: dict[str, float] = dict.fromkeys(
            ("prompt_tokens_evaluated", "prompt_tokens_reused", "generated_tokens", "prefill_s", "decode_s",
             "decode_steps", "decoded_sequences"), 0)
        threading.Thread(target=self._loop, daemon=True).start()

    @make(max_concurrency=8)
    def generate(self, prompt: str, max_tokens: int = 64) -> str:
        words, answer = prompt.split(" / ")[0].split(), min(int(prompt.split(" / ")[1]), max_tokens)
        with self.lock:
            shared = max((_common(words[:-1], kept) for kept in self.cached), default=0) // BLOCK * BLOCK
            self.cached.append(words)
            self.counts["prompt_tokens_reused"] += shared
            sequence = _Sequence(len(words) - shared, answer)
            self.running.append(sequence)
            self.lock.notify()
        sequence.done.wait()
        return "x" * sequence.made

    def profile_call(self, method: str, call: tuple[tuple[Any, ...], dict[str, Any]], max_tokens: int) -> Any:
        args, kwargs = call
        return args, {**kwargs, "max_tokens": max_tokens}

    def stats(self) -> dict[str, float]:
        with self.lock:
            return dict(self.counts)

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.running:
                    self.lock.wait()
                prompts = [s for s in self.running if s.evaluate]
                ready = [s for s in self.running if not s.evaluate]
            for sequence in prompts:
                time.sleep(sequence.evaluate * PROMPT_MS / 1000)
                with self.lock:
                    self.counts["prompt_tokens_evaluated"] += sequence.evaluate
                    self.counts["prefill_s"] += sequence.evaluate * PROMPT_MS / 1000
                    sequence.evaluate = 0
                    sequence.made = 1  # the first token comes from the prompt's evaluation
                    self.counts["generated_tokens"] += 1
            ready = [s for s in [*ready, *prompts] if s.made < s.answer]
            if ready:
                time.sleep(step_ms(len(ready)) / 1000)
            with self.lock:
                if ready:
                    self.counts["decode_steps"] += 1
                    self.counts["decoded_sequences"] += len(ready)
                    self.counts["decode_s"] += step_ms(len(ready)) / 1000
                    self.counts["generated_tokens"] += len(ready)
                for sequence in ready:
                    sequence.made += 1
                for sequence in [s for s in self.running if not s.evaluate and s.made >= s.answer]:
                    self.running.remove(sequence)
                    sequence.done.set()


def _common(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def engine_pipeline(engine: Component, prompts: list[str]) -> patchkit.Pipeline:
    prompt = prompts[0]
    with patchkit.capture(run=False) as pipeline:
        answer = engine.generate(prompt)  # noqa: F841 - the pipeline's output
    for text in prompts:
        pipeline(prompt=text)
    return pipeline


@pytest.mark.slow
def test_an_engine_of_known_costs_is_profiled_through_its_cost_model() -> None:
    documents = " ".join(f"doc{i}" for i in range(64))
    prompts = [f"{documents} grade {i} / 2" for i in range(2)] + [f"{documents} answer {i} / 30" for i in range(2)]
    pipeline = engine_pipeline(SleepingEngine(), prompts)
    [profile] = Profiler(ResourcePool({"cpu": 1}), progress=False).run(pipeline)
    method = profile.methods["generate"]
    assert method.model is not None
    costs = EngineCosts.from_description(method.model["costs"])
    assert costs.prompt_ms_per_token == pytest.approx(PROMPT_MS, rel=0.05)
    for k in (1, 4, 8):  # a step's time as the caller sees it: the sleep, and the loop's own work around it
        assert costs.step(k) == pytest.approx(step_ms(k), rel=0.25)
    # the calls after the first reuse the documents it left cached: 64 of their 66 tokens
    assert [c[1] for c in method.model["calls"]] == [66, 2, 2, 2]
    assert method.model["error"] <= 0.15  # whole calls, one at a time and 8 at once, as predicted
    points = dict(method.points)
    assert sorted(points) == [1, 2, 3, 4, 6, 8] and profile.max_batch == 8
    assert 8 / points[8] > 2 * (1 / points[1])  # decode steps shared: more than twice the calls/s at 8 at once


@pytest.mark.slow
@pytest.mark.skipif(len(available_cpus()) < 2, reason="needs 2 cores to profile at 2 threads")
def test_an_engine_no_faster_at_more_threads_stops_after_its_prompts(profile_cache: Path) -> None:
    prompts = [f"{' '.join(f'doc{i}' for i in range(64))} answer {i} / 8" for i in range(2)]
    profiles = Profiler(ResourcePool({"cpu": 2}), progress=False).run(engine_pipeline(SleepingEngine(), prompts))
    assert [p.threads for p in profiles] == [1]  # sleeping costs the same at 2 threads: not worth planning
    stored = [json.loads(path.read_text()) for path in profile_cache.glob("*.json")]
    [stopped] = [data["model"] for data in stored if "stopped" in data["model"]]
    assert "profiled no further" in stopped["stopped"]  # at 2 threads, only the prompts were measured


# -- SmolLM2 -------------------------------------------------------------------------------------------------

QUESTIONS = ["What does the with statement do?", "How do I catch an exception?", "What is a generator?"]
DOCS = [
    ["The with statement wraps a block with methods defined by a context manager.",
     "A context manager's __exit__ runs even when the block raises."],
    ["The try statement specifies exception handlers for a group of statements.",
     "An except clause names the exceptions it handles."],
    ["A generator function returns an iterator that yields values one at a time.",
     "Calling next() on a generator runs it to its next yield expression."],
]


@pytest.mark.slow
def test_smollm2_is_profiled_from_short_calls_and_predicts_whole_calls() -> None:
    llm = LlamaCppGenerator(max_tokens=32)
    question, docs = QUESTIONS[0], DOCS[0]
    with patchkit.capture(run=False) as pipeline:
        answer = llm.generate(question, docs)  # noqa: F841 - the pipeline's output
    for q, d in zip(QUESTIONS, DOCS):
        pipeline(question=q, docs=d)
    [profile] = Profiler(ResourcePool({"cpu": 1}), progress=False).run(pipeline)
    method = profile.methods["generate"]
    assert method.model is not None
    calls = [EngineCall(*c) for c in method.model["calls"]]
    assert len(calls) == 3 and all(0 < c.evaluated <= c.prompt_tokens and c.steps > 0 for c in calls)
    # whole calls of up to 32 tokens, one at a time and 8 at once, within 25% of the model fitted on
    # 1- and 16-token calls (a shared 2-core machine; about 5% when it is quiet)
    assert method.model["error"] <= 0.25
    points = dict(method.points)
    # A batch of 16 is profiled, and takes longer than one call. Whether it costs less than 16 calls one at a
    # time is the host's: where the model's weights stay in cache a decode step is compute-bound and costs each
    # sequence its own step (seen here: 6.3 ms a step for one sequence, 38 ms for 5.5), which the fit above
    # must then predict, as its error says.
    assert max(points) == 16 and points[16] > points[8] > points[1]
