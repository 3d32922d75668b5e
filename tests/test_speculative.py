"""Speculative retrieval: the stride scheduler's arithmetic, the cache answering exactly as FAISS
does, verification and rollback (in the call and in the background, on this process or another),
and the example loop giving the plain retriever's outputs, eagerly and deployed on workers."""

from __future__ import annotations

import pickle
import runpy
from pathlib import Path
from typing import Any

import pytest

from patchkit.components.stride import estimate_gamma, expected_verified, optimal_stride, stride_throughput

ROOT = Path(__file__).resolve().parent.parent


# -- the optimal speculation stride scheduler: pure arithmetic ------------------------------------
def test_expected_verified_is_the_geometric_prefix() -> None:
    assert expected_verified(0.0, 5) == 1.0  # the verification itself answers the first retrieval
    assert expected_verified(1.0, 4) == 4.0
    assert expected_verified(0.5, 3) == pytest.approx(1 + 0.5 + 0.25)


def test_a_slow_index_and_good_guesses_call_for_long_strides() -> None:
    assert optimal_stride(0.1, 2.0, 0.95, asynchronous=False, max_stride=8) >= 4
    assert optimal_stride(0.1, 0.01, 0.6, asynchronous=False, max_stride=8) == 1
    assert optimal_stride(0.1, 2.0, 0.0, asynchronous=False, max_stride=8) == 1  # every guess wrong: never wait for more
    assert optimal_stride(0.1, 2.0, 0.99, asynchronous=False, max_stride=3) == 3


def test_async_verification_faster_than_decoding_wants_stride_one() -> None:
    # RaLMSpec section 3: when verification hides behind one decoding step, stride 1 is optimal.
    assert optimal_stride(1.0, 0.5, 0.6, asynchronous=True, max_stride=8) == 1
    assert stride_throughput(1, 1.0, 0.5, 0.6, asynchronous=True) > stride_throughput(1, 1.0, 0.5, 0.6, asynchronous=False)


def test_gamma_is_the_maximum_likelihood_estimate_capped() -> None:
    assert estimate_gamma([], 0.6) == 0.6
    assert estimate_gamma([(3, 1)], 0.9) == pytest.approx(1 / 2)  # one match, then a mismatch
    assert estimate_gamma([(2, 2), (2, 0)], 0.9) == pytest.approx(2 / 3)
    assert estimate_gamma([(4, 4), (4, 4)], 0.6) == 0.6


def test_scheduler_rejects_what_it_cannot_use() -> None:
    with pytest.raises(ValueError, match="gamma"):
        optimal_stride(1.0, 1.0, 1.5, asynchronous=False, max_stride=4)
    with pytest.raises(ValueError, match="latencies"):
        optimal_stride(-1.0, 1.0, 0.5, asynchronous=False, max_stride=4)


# -- the retriever on real FAISS + MiniLM over a small corpus (a real model: slow) ----------------
TOPICS = {
    "loops": "The break statement leaves a for or while loop early; continue skips to the next iteration.",
    "exceptions": "A try statement catches exceptions; except clauses name the exception types they handle.",
    "files": "The open function returns a file object; read and write move text in and out of files.",
    "classes": "A class statement defines a new type; methods take self as their first parameter.",
    "generators": "A generator function uses yield to produce values lazily, one at a time.",
    "with": "The with statement calls __enter__ and __exit__ of a context manager around a block.",
}


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Any:
    pytest.importorskip("faiss", reason="the base retriever is a FAISS index: pip install -e '.[retrieval]'")
    pytest.importorskip("sentence_transformers", reason="the Embedder needs sentence-transformers: pip install -e '.[retrieval]'")
    from patchkit.components import Embedder, FaissRetriever

    monkey = pytest.MonkeyPatch()
    monkey.setenv("PATCHKIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    embedder = Embedder()
    base = FaissRetriever(list(TOPICS.values()), topk=1, embedder=embedder)
    yield base
    monkey.undo()


def speculative(base: Any, **options: Any) -> Any:
    from patchkit.components import SpeculativeRetriever

    return SpeculativeRetriever(base, **options)


@pytest.mark.slow
def test_bad_arguments_name_the_fix(parts: Any) -> None:
    from patchkit.components import SpeculativeRetriever

    with pytest.raises(ValueError, match=r"cache_topk \(1\) must be >= the base retriever's topk \(2\)"):
        SpeculativeRetriever(type(parts)(list(TOPICS.values()), topk=2), cache_topk=1)
    with pytest.raises(ValueError, match="stride must be 'auto'"):
        speculative(parts, stride=0)
    with pytest.raises(TypeError, match="VectorRetriever base"):
        SpeculativeRetriever("pydoc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="takes the state start"):
        speculative(parts).retrieve("not a state", "loops")


@pytest.mark.slow
def test_the_cache_answers_exactly_what_the_base_answers_when_it_holds_the_top_hit(parts: Any) -> None:
    retriever = speculative(parts, cache_topk=6, stride=8, async_verify=False)  # the whole corpus is cached
    state = retriever.start("How do I leave a loop?")
    for query in ("What does yield do?", "How do I open a file?", "What is a context manager?"):
        state = retriever.retrieve(state, query)
        assert state.docs == parts.retrieve(query)  # ids, texts and FAISS's own scores
    assert len(state.unverified) == 3 and state.verifications == 0  # answered from the cache alone
    state = retriever.settle(state)
    assert state.verified and state.rollback is None and state.hits == 3


@pytest.mark.slow
def test_a_wrong_guess_found_in_the_call_rolls_back_to_it(parts: Any) -> None:
    retriever = speculative(parts, cache_topk=1, stride=2, async_verify=False)  # the cache holds one document
    state = retriever.start("How do I leave a loop?")
    state = retriever.retrieve(state, "How do I catch an exception?")  # retrieval 1: the loop document, wrong
    assert state.docs[0].title.startswith("The break statement") and not state.verified
    state = retriever.retrieve(state, "How do I leave a loop early?")  # retrieval 2 fills the stride: verify 1 and 2
    assert state.rollback == 1
    assert state.docs == parts.retrieve("How do I catch an exception?")
    assert state.retrievals == 2 and state.verified  # the next call is retrieval 2 again
    state = retriever.retrieve(state, "How do I catch exceptions in Python?")  # now cached: a hit
    assert state.docs == parts.retrieve("How do I catch exceptions in Python?")


@pytest.mark.slow
def test_a_background_verification_is_collected_by_the_next_call(parts: Any) -> None:
    retriever = speculative(parts, cache_topk=1, stride=1, async_verify=True)
    state = retriever.start("How do I leave a loop?")
    state = retriever.retrieve(state, "How do I catch an exception?")  # answered, verification launched
    assert state.pending is not None and state.rollback is None
    after = retriever.retrieve(state, "anything the pipeline wrote from the wrong document")
    assert after.rollback == 1 and after.docs == parts.retrieve("How do I catch an exception?")
    assert after.pending is None and after.verified and after.rollbacks == 1


@pytest.mark.slow
def test_the_state_travels_to_another_replica_which_verifies_again(parts: Any) -> None:
    first = speculative(parts, cache_topk=1, stride=1, async_verify=True)
    state = first.retrieve(first.start("How do I leave a loop?"), "How do I catch an exception?")
    other = speculative(parts, cache_topk=1, stride=1, async_verify=True)  # as a worker rebuilds it
    after = other.retrieve(pickle.loads(pickle.dumps(state)), "next")
    assert after.rollback == 1 and after.docs == parts.retrieve("How do I catch an exception?")
    assert other.totals["recomputed"] == 1


@pytest.mark.slow
def test_auto_stride_checks_a_requests_first_guess_at_once_and_seeds_later_requests(parts: Any) -> None:
    retriever = speculative(parts, cache_topk=6, async_verify=False)  # stride "auto"
    first = retriever.start("How do I leave a loop?")
    assert first.stride == 1 and first.decode_s is None  # this replica has measured no decoding yet
    first.returned_at -= 5.0  # the pipeline decodes for 5 s: the state carries when `start` answered it
    first = retriever.retrieve(first, "What does yield do?")
    assert first.verified and first.verifications == 1  # the first guess is verified in its own call
    assert first.decode_s is not None and first.decode_s >= 5.0  # the time since `start` answered, read from the state
    second = retriever.start("How do I open a file?")
    assert second.stride == 1  # every request's first guess, however good the last request's were
    assert second.decode_s == first.decode_s  # but its estimate starts from what this replica measured


@pytest.mark.slow
def test_calls_leave_the_state_they_were_given_alone(parts: Any) -> None:
    retriever = speculative(parts, stride=1, async_verify=False)
    state = retriever.start("How do I leave a loop?")
    retriever.retrieve(state, "How do I catch an exception?")
    assert state.retrievals == 1 and not state.unverified


# -- the example: identical outputs to the plain retriever, eagerly and deployed ------------------
QUESTIONS = ("Which statement do I use to leave a loop early?", "How do I catch an exception?")


@pytest.fixture(scope="module")
def example() -> dict[str, Any]:
    pytest.importorskip("llama_cpp", reason="the example answers with SmolLM2 through llama.cpp: pip install -e '.[llm]'")
    pytest.importorskip("faiss", reason="the example searches a FAISS index: pip install -e '.[retrieval]'")
    return runpy.run_path(str(ROOT / "examples" / "speculative.py"), run_name="speculative_example")


@pytest.mark.slow
def test_every_configuration_answers_as_the_plain_retriever(example: dict[str, Any]) -> None:
    from patchkit.components import SpeculativeRetriever

    base, llm = example["base"], example["llm"]
    configs = [
        # the example's own configuration runs deployed below
        {"cache_topk": 2, "stride": 3, "async_verify": False},  # a cache of two: many wrong guesses
        {"cache_topk": 2, "stride": 2, "async_verify": True},
    ]
    rollbacks = 0
    for question in QUESTIONS:
        expected = example["plain_rounds"](question, base, llm)
        assert len(expected["thoughts"]) == example["ROUNDS"]
        for config in configs:
            retriever = SpeculativeRetriever(base, **config)
            assert example["speculative_rounds"](question, retriever, llm) == expected, config
            rollbacks += retriever.totals["rollbacks"]
    assert rollbacks > 0  # the rollback path ran, and still gave the same outputs


@pytest.mark.slow
def test_deployed_on_workers_it_answers_as_the_plain_pipeline_eagerly(example: dict[str, Any]) -> None:
    import asyncio

    import patchkit

    pipeline, plain = example["pipeline"], example["plain"]
    assert set(pipeline.inputs) == {"question"}
    expected = [plain(question=q) for q in QUESTIONS]

    async def together(endpoint: patchkit.Endpoint) -> list[Any]:
        return list(await asyncio.gather(*(endpoint.aquery(question=q) for q in QUESTIONS)))

    with patchkit.deploy(pipeline, batch_size=4) as endpoint:
        outputs = asyncio.run(together(endpoint))
        stats = endpoint.stats()["components"]
    assert outputs == expected
    assert stats["retriever"]["class"] == "SpeculativeRetriever"
    assert stats["retriever"]["methods"]["settle"]["calls"] >= len(QUESTIONS)
