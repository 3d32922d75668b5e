"""The real-model stream benchmarks' arithmetic: what prefix reuse could add at best."""

from __future__ import annotations

import random
from typing import Any

import pytest

from benchmarks.prefix_replay import replay
from benchmarks.question_stream import unshared_tokens
from benchmarks.rag_stream import Run, cache_ceiling


def found(evaluated_without: float, unshared: float) -> tuple[dict[str, Any], dict[str, Run]]:
    """A run of both deployed arms on 10 questions over 2 one-thread engines: the arm without the
    document cache evaluated `evaluated_without` prompt tokens; `unshared` a question no earlier prompt shares."""
    layout = {"threads": 1.0, "engines": 2, "prompt_tok_s": 100.0, "decode_tok_s_batched": 50.0}
    result = {"cores": 2, "settings": {"replicas": 2}, "bound": {"layouts": [layout]},
              "workload": {"unshared_prompt_tokens": unshared, "generated_tokens": 50.0}}
    answers = {i: {"answer": "a", "documents": []} for i in range(10)}
    runs = {"deployed": Run("deployed", outputs=answers, seconds=8.0),
            "deployed-no-doc-cache": Run("deployed-no-doc-cache", outputs=answers, seconds=10.0,
                                         counters={"prompt_tokens_evaluated": evaluated_without})}
    return result, runs


def test_the_ceiling_is_the_arms_time_against_perfect_reuse_with_decoding_unchanged() -> None:
    # 10 questions: 3,000 tokens evaluated = 30 s, 1,000 unshared = 10 s, 500 generated = 10 s on each side.
    line = cache_ceiling(*found(3000.0, 100.0))
    assert "1.25x deployed-no-doc-cache" in line
    assert "could add to that arm: 2.00x" in line


def test_no_ceiling_above_one_when_the_arm_already_reused_every_shared_prefix() -> None:
    assert "could add to that arm: 1.00x" in cache_ceiling(*found(1000.0, 100.0))


@pytest.mark.parametrize("missing", ["deployed", "deployed-no-doc-cache"])
def test_no_ceiling_without_both_arms(missing: str) -> None:
    result, runs = found(3000.0, 100.0)
    del runs[missing]
    assert cache_ceiling(result, runs) == ""


# --- the prefix replay -----------------------------------------------------------------------------------
SYSTEM = (1, 2, 3, 4)


def prompt(*docs: tuple[int, ...], question: tuple[int, ...] = (99,)) -> tuple[list[int], list[int]]:
    """A prompt of the system piece, `docs` and a question, with its pieces' ends."""
    tokens, ends = list(SYSTEM), [len(SYSTEM)]
    for doc in docs:
        tokens += doc
        ends.append(len(tokens))
    return tokens + list(question), ends


A, B, C = (10, 11, 12, 13), (20, 21, 22, 23), (30, 31, 32, 33)


def test_a_slot_serves_the_prefix_it_holds_cut_to_a_block_boundary() -> None:
    stream = [prompt(A, B, question=(90,)), prompt(A, C, question=(91,))]
    assert replay(stream, engines=1, slots=4, documents=False, block=1) == [13, 13 - 8]
    assert replay(stream, engines=1, slots=4, documents=False, block=3) == [13, 13 - 6]


def test_the_last_token_is_always_evaluated() -> None:
    same = prompt(A)
    assert replay([same, same], engines=1, slots=2, documents=False, block=1) == [9, 1]


def test_the_document_cache_serves_what_the_slots_lost() -> None:
    stream = [prompt(A, B, question=(90,)), prompt(C, question=(91,)), prompt(A, B, question=(92,))]
    assert replay(stream, engines=1, slots=1, documents=False, block=1)[-1] == 13 - 4  # only the system piece
    assert replay(stream, engines=1, slots=1, documents=True, block=1)[-1] == 1  # the system piece, A and B restored


def test_a_first_document_goes_back_to_the_engine_that_served_it() -> None:
    stream = [prompt(A, question=(90,)), prompt(B, question=()), prompt(A, question=(92,))]
    # The third is not sent to the less loaded second engine, which holds nothing of it.
    assert replay(stream, engines=2, slots=4, documents=False, block=1) == [9, 8, 1]


def test_the_policies_are_ordered_on_a_random_stream() -> None:
    rng = random.Random(3)
    docs = [tuple(rng.randrange(1000) for _ in range(rng.randrange(3, 9))) for _ in range(12)]
    stream = [prompt(*rng.sample(docs[: rng.randrange(3, 12)], 3), question=(rng.randrange(1000), 7)) for _ in range(60)]
    slots = sum(replay(stream, engines=2, slots=3, documents=False, block=1))
    cached = sum(replay(stream, engines=2, slots=3, documents=True, block=1))
    perfect = sum(unshared_tokens([tokens for tokens, _ in stream]))
    assert perfect <= cached < slots


def test_a_replay_needs_an_engine_a_slot_and_a_block() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        replay([prompt(A)], engines=1, slots=0, documents=False, block=1)


def with_bodies(tokens: list[int], ends: list[int]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """The prompt with each document's body: its piece less a one-token label."""
    return tokens, ends, [(a + 1, b) for a, b in zip(ends, ends[1:])]


def test_blend_spares_the_documents_seen_before_wherever_they_stand_but_their_recomputed_start() -> None:
    stream = [with_bodies(*prompt(A, B, question=(90,))), with_bodies(*prompt(B, A, question=(91,)))]
    # The second shares only the system piece with the first: exact reuse evaluates both documents again.
    assert replay(stream, engines=1, slots=1, documents=True, block=1) == [13, 9]
    # Blend evaluates the first sights in place and keeps their cells (the first prompt costs what exact's
    # does), then places both documents: the labels and the question remain.
    assert replay(stream, engines=1, slots=1, documents=True, block=1, blend=0.0) == [13, 3]
    # Recomputing half of each body (2 of 3 tokens, rounded up) spares one token of each.
    assert replay(stream, engines=1, slots=1, documents=True, block=1, blend=0.5) == [13, 7]
    assert replay(stream, engines=1, slots=1, documents=True, block=1, blend=1.0) == [13, 9]
