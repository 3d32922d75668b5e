"""The benchmark's question stream: new questions every time, over modules whose popularity is skewed."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from benchmarks.question_stream import Question, catalogue, draw, fit_zipf, popularity, unshared_tokens
from patchkit.components.documents import pydoc_corpus


@pytest.fixture(scope="module")
def questions() -> dict[str, list[Question]]:
    modules = {doc.title for doc in pydoc_corpus(topics=False)}
    return catalogue(modules, seed=0)


def synthetic(modules: int, each: int) -> dict[str, list[Question]]:
    return {f"m{i}": [Question(f"q{i}.{j}", f"m{i}.f{j}", f"m{i}") for j in range(each)] for i in range(modules)}


def test_the_catalogue_asks_about_the_corpus_modules_and_their_definitions(questions: dict[str, list[Question]]) -> None:
    assert {"csv", "heapq", "json", "math"} <= set(questions)
    assert all(q.module == module for module, qs in questions.items() for q in qs)
    assert Question("What is the heapq module for?", "heapq", "heapq") in questions["heapq"]
    assert "heapq.heappush" in {q.subject for q in questions["heapq"]}  # read from source
    assert "math.sqrt" in {q.subject for q in questions["math"]}  # a built-in module: read from its members
    texts = [q.text for qs in questions.values() for q in qs]
    assert len(texts) == len(set(texts)) > 1000


def test_a_stream_never_repeats_a_question_and_is_the_same_for_a_seed(questions: dict[str, list[Question]]) -> None:
    stream = draw(questions, 300, seed=3)
    assert len(stream) == 300 and len({q.text for q in stream}) == 300
    assert draw(questions, 300, seed=3) == stream
    assert draw(questions, 300, seed=4) != stream
    assert catalogue(questions, seed=0) == questions


def test_modules_are_drawn_by_a_zipf_law_while_questions_stay_new() -> None:
    stream = draw(synthetic(60, 400), 3000, s=1.0, seed=1)
    counts = sorted(Counter(q.module for q in stream).values(), reverse=True)
    assert 0.85 <= fit_zipf(counts) <= 1.15
    top = sum(counts[: math.ceil(0.2 * 60)]) / len(stream)
    assert top > 0.6  # 1/r over 60 modules: the top 12 draw 67%
    flat = sorted(Counter(q.module for q in draw(synthetic(60, 400), 3000, s=0.0, seed=1)).values(), reverse=True)
    assert fit_zipf(flat) < 0.2 and sum(flat[:12]) / 3000 < 0.3


def test_a_module_that_runs_out_leaves_the_draw_and_too_long_a_stream_is_refused() -> None:
    few = synthetic(3, 10)
    stream = draw(few, 30, s=2.0, seed=0, min_questions=1)
    assert len({q.text for q in stream}) == 30
    with pytest.raises(ValueError, match="31 questions asked for, but the 3 modules"):
        draw(few, 31, seed=0, min_questions=1)
    assert {q.module for q in draw({**few, "tiny": few["m0"][:2]}, 30, seed=0)} == {"m0", "m1", "m2"}


def test_popularity_measures_the_retrievals() -> None:
    retrieved = [["a", "b"], ["a", "c"], ["a", "b"], ["b", "a"]]
    found = popularity(retrieved, corpus=50)
    assert (found.retrievals, found.documents, found.corpus) == (8, 3, 50)
    assert found.top_share == 0.5  # the top 20% of the 3 documents retrieved: "a", 4 of 8 retrievals
    assert found.top_corpus_share == 1.0  # the top 10 of the corpus hold every retrieval
    assert found.repeat_share == 5 / 8  # retrievals of a document already retrieved
    assert found.zipf_s == fit_zipf([4, 3, 1]) and 0.5 < found.zipf_s < 1.5
    with pytest.raises(ValueError, match="corpus"):
        popularity(retrieved, corpus=2)


def test_the_zipf_fit_recovers_the_exponent_of_exact_counts() -> None:
    for s in (0.5, 1.0, 1.5):
        counts = [round(100_000 / rank**s) for rank in range(1, 200)]
        assert fit_zipf(counts) == pytest.approx(s, abs=0.01)
    assert fit_zipf([7] * 10) == pytest.approx(0.0, abs=1e-6)  # uniform


def test_unshared_tokens_are_those_past_the_longest_prefix_an_earlier_prompt_shares() -> None:
    system, doc_a, doc_b = [1, 2], [10, 11, 12], [20, 21]
    prompts = [system + doc_a + [5], system + doc_a + [6, 7], system + doc_b + [5], system + doc_a + [5]]
    assert unshared_tokens(prompts) == [6, 2, 3, 1]  # a prompt asked again still evaluates its last token
    assert unshared_tokens([system + doc_b, system + doc_a]) == [4, 3]
