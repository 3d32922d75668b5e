"""VLLMGenerator: its arguments checked at construction anywhere; real batched generation on an
NVIDIA GPU with vllm installed and SmolLM2-135M-Instruct in the local Hugging Face cache: calls in
flight together, streamed, and deployed.

The GPU tests run the model in float32: vLLM does not promise that a prompt's greedy answer is the
same in every batch, and float32 keeps the logits of a batched prompt close enough to its logits
alone that only a near-tie could change a token.
"""

from __future__ import annotations

import functools
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from serving import ask_deployed_together

from patchkit.components import VLLMGenerator
from patchkit.core import ensure_setup
from patchkit.core.options import CallReport
from patchkit.orchestrator.execute import run_batch

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
QUESTIONS = [
    "What is a Python generator? Answer in one sentence.",
    "Name a Python keyword used to define a function.",
    "Hi",
    "Explain list comprehensions in Python, with an example, in two or three sentences please.",
    "What is the GIL?",
    "How do I sort a list?",
    "What does the try statement do?",
    "What is a virtual environment?",
]
TOO_LONG = "word " * 3000  # past the max_model_len of 2048 below


def test_a_missing_local_model_fails_at_construction(tmp_path: Path) -> None:
    for model in (str(tmp_path / "missing"), "./missing-model", "~/missing/model", "a/b/c"):
        with pytest.raises(FileNotFoundError, match="does not exist; pass a local model directory or the id of a model"):
            VLLMGenerator(model)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization \(1.5\) must be in \(0, 1\]"):
        VLLMGenerator(str(tmp_path), gpu_memory_utilization=1.5)


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="an NVIDIA GPU is present")
def test_setup_without_a_gpu_says_what_to_use_instead(tmp_path: Path) -> None:
    llm = VLLMGenerator(str(tmp_path))
    with pytest.raises(RuntimeError, match="needs an NVIDIA GPU.*; use TransformersGenerator or LlamaCppGenerator on CPU"):
        ensure_setup(llm)


@pytest.fixture(scope="module")
def llm() -> VLLMGenerator:
    """The generator, set up; skips without vllm or without the model in the local cache."""
    pytest.importorskip("vllm")
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(MODEL, "config.json"), str):
        pytest.skip(f"{MODEL} is not in the local Hugging Face cache: huggingface-cli download {MODEL}")
    # A third of the GPU each, so that the deployed worker's engine fits beside this one.
    generator = VLLMGenerator(MODEL, max_tokens=16, dtype="float32", max_model_len=2048, gpu_memory_utilization=0.3)
    ensure_setup(generator)
    return generator


@functools.cache
def alone(llm: VLLMGenerator, question: str) -> str:
    return llm.generate(question)


@pytest.mark.gpu
def test_calls_in_flight_together_answer_as_each_alone(llm: VLLMGenerator) -> None:
    with ThreadPoolExecutor(len(QUESTIONS)) as pool:
        answers = list(pool.map(llm.generate, QUESTIONS))
    assert answers == [alone(llm, q) for q in QUESTIONS]
    assert len(set(answers)) == len(answers)
    assert all(answers)


@pytest.mark.gpu
def test_the_stream_joins_to_the_answer_and_closing_it_aborts_the_request(llm: VLLMGenerator) -> None:
    *chunks, report = VLLMGenerator.generate.chunks(llm, (QUESTIONS[0],), {})
    assert len(chunks) >= 3 and "".join(chunks) == alone(llm, QUESTIONS[0])  # type: ignore[arg-type]
    assert isinstance(report, CallReport) and report.completion_tokens > 0
    stream = VLLMGenerator.generate.chunks(llm, (QUESTIONS[3],), {"max_tokens": 1000})
    assert next(stream)
    stream.close()  # aborts the request in the engine, which goes on serving
    assert llm.generate(QUESTIONS[1]) == alone(llm, QUESTIONS[1])
    llm.check_health()


@pytest.mark.gpu
def test_a_prompt_past_the_context_is_a_clear_error_and_fails_alone(llm: VLLMGenerator) -> None:
    with pytest.raises(ValueError, match="more than the model's context of 2048 tokens; shorten the question"):
        llm.generate(TOO_LONG)
    outcomes = run_batch(llm, "generate", [((QUESTIONS[1],), {}), ((TOO_LONG,), {}), ((QUESTIONS[2],), {})])
    assert [ok for ok, _ in outcomes] == [True, False, True]
    assert [outcomes[0][1], outcomes[2][1]] == [alone(llm, QUESTIONS[1]), alone(llm, QUESTIONS[2])]


@pytest.mark.slow
@pytest.mark.gpu
def test_deployed_calls_answer_as_local_calls(llm: VLLMGenerator) -> None:
    answers, generate = ask_deployed_together(llm, QUESTIONS)
    assert answers == [alone(llm, q) for q in QUESTIONS]
    assert generate["calls"] == len(QUESTIONS)
