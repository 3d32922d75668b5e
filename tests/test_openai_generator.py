"""OpenAIGenerator against a real llama-cpp-python OpenAI-compatible server serving the SmolLM2 GGUF:
streamed answers, calls in flight together, locally and deployed.

The server's default repeat_penalty (1.1, not an OpenAI field) differs from llama-cpp-python's own
(1.0), so the answers match `LlamaCppGenerator`'s only with `extra_body={"repeat_penalty": 1.0}`.
"""

from __future__ import annotations

import functools
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from serving import run_frontend

pytest.importorskip("llama_cpp")
pytest.importorskip("llama_cpp.server.app", reason="needs llama-cpp-python[server]")

import patchkit  # noqa: E402
from patchkit.components import Hit, OpenAIGenerator  # noqa: E402
from patchkit.components.generators import LlamaCppGenerator, default_gguf_path  # noqa: E402
from patchkit.core import ensure_setup  # noqa: E402
from patchkit.core.options import CallOptions, CallReport  # noqa: E402
from patchkit.orchestrator.execute import run_batch  # noqa: E402
from patchkit.serving.frontend import Frontend  # noqa: E402

pytestmark = pytest.mark.slow

API_KEY = "patchkit-test-key"
SAME_SAMPLING = {"repeat_penalty": 1.0}  # llama-cpp-python's own default, which LlamaCppGenerator uses
QUESTIONS = [
    "What is a Python generator? Answer in one sentence.",
    "Name a Python keyword used to define a function.",
    "What does len() return?",
    "What is a list?",
]

local = LlamaCppGenerator(max_tokens=16, threads=1)


@functools.cache
def local_answer(question: str, max_tokens: int | None = None) -> str:
    """LlamaCppGenerator's answer, computed once: the tests compare several server answers to each."""
    return local.generate(question, max_tokens=max_tokens)


def same_opening(answer: str, expected: str, words: int = 8) -> bool:
    """Whether two greedy answers open alike. The server evaluates only the part of a prompt past the
    prefix it shares with the prompt before, so what it answers depends slightly on the requests that
    came before (a prompt evaluated in other pieces rounds differently); at a near tie, late in an
    answer, that can pick another word. The first words are the answer to the question asked."""
    return answer.split()[:words] == expected.split()[:words]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the server writes what it does: it prints "disconnected" when a client leaves a stream."""
    return tmp_path_factory.mktemp("openai-server") / "server.log"


@pytest.fixture(scope="module")
def base_url(server_log: Path) -> Iterator[str]:
    """A llama-cpp-python server on a free port, ready to answer; killed after the module's tests. It
    serves one request at a time; --interrupt_requests False keeps it from cutting a stream short when
    another request arrives (its default)."""
    port = free_port()
    log = server_log
    command = [
        # Through patchkit's loader: llama-cpp-python's server loads the model as the generator does (no AMX repack).
        sys.executable, "-m", "patchkit.components.generators.llama.loading", "llama_cpp.server",
        "--model", str(default_gguf_path()), "--host", "127.0.0.1",
        "--port", str(port), "--n_ctx", "2048", "--n_threads", "1", "--api_key", API_KEY, "--interrupt_requests", "False",
    ]
    with log.open("wb") as out:
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        wait_until_serving(server, url, log)
        yield url
    finally:
        server.kill()
        server.wait()


def wait_until_serving(server: subprocess.Popen[bytes], url: str, log: Path, timeout_s: float = 120.0) -> None:
    request = urllib.request.Request(url + "/models", headers={"Authorization": f"Bearer {API_KEY}"})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the llama-cpp-python server exited with {server.returncode}:\n{log.read_text(errors='replace')}")
        try:
            with urllib.request.urlopen(request, timeout=5):
                return
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.25)
    pytest.fail(f"the llama-cpp-python server did not answer {url}/models in {timeout_s} s:\n{log.read_text(errors='replace')}")


@pytest.fixture(scope="module")
def llm(base_url: str) -> OpenAIGenerator:
    return OpenAIGenerator(base_url, api_key=API_KEY, max_tokens=16, extra_body=SAME_SAMPLING)


def test_answers_are_real_deterministic_and_equal_llamacpp_ones(base_url: str, llm: OpenAIGenerator) -> None:
    served = OpenAIGenerator(base_url, api_key=API_KEY, max_tokens=16)
    first = served.generate(QUESTIONS[0])
    assert len(first.split()) >= 5
    assert served.generate(QUESTIONS[0]) == first
    assert served.model == str(default_gguf_path())  # asked of the server at setup: its first model
    assert same_opening(llm.generate(QUESTIONS[0]), local_answer(QUESTIONS[0]))


def test_calls_in_flight_together_answer_in_order_as_each_alone(llm: OpenAIGenerator) -> None:
    hit = Hit("topic:def#0", "def", "The def statement defines a function.", 0.9)
    calls = [
        ((QUESTIONS[0],), {}),
        ((QUESTIONS[1], [hit]), {}),
        ((QUESTIONS[2],), {"max_tokens": 6}),
        ((QUESTIONS[3], None, 12), {}),
    ]
    with ThreadPoolExecutor(len(calls)) as pool:  # each call in a thread of its own, as a replica runs them
        together = list(pool.map(lambda call: llm.generate(*call[0], **call[1]), calls))
    alone = [llm.generate(*args, **kwargs) for args, kwargs in calls]
    assert all(same_opening(a, b) for a, b in zip(together, alone)), (together, alone)
    assert len(set(together)) == 4
    assert together[2] == local_answer(QUESTIONS[2], 6)


def test_the_answer_streams_delta_by_delta(llm: OpenAIGenerator) -> None:
    *chunks, report = OpenAIGenerator.generate.chunks(llm, (QUESTIONS[0],), {})
    text = [chunk for chunk in chunks if isinstance(chunk, str)]
    assert len(text) == len(chunks) >= 5  # one per delta: the server streamed it
    assert text[0] == text[0].lstrip() and text[-1] == text[-1].rstrip()
    assert same_opening("".join(text), local_answer(QUESTIONS[0]))
    # llama-cpp-python's server sends no usage in a stream: the report says its counts are not the server's.
    assert isinstance(report, CallReport) and not report.counted


def test_options_reach_the_server(base_url: str, llm: OpenAIGenerator) -> None:
    import openai

    options = CallOptions(max_tokens=4, temperature=0.0)
    *chunks, report = OpenAIGenerator.generate.chunks(llm, (QUESTIONS[0],), {"options": options})
    with openai.OpenAI(base_url=base_url, api_key=API_KEY) as direct:  # the same request, asked of the server itself
        asked = direct.chat.completions.create(model=str(default_gguf_path()), messages=llm.messages(QUESTIONS[0]),
                                               max_tokens=4, temperature=0.0, extra_body=SAME_SAMPLING)  # type: ignore[arg-type]
    assert isinstance(report, CallReport) and report.finish_reason == "length" == asked.choices[0].finish_reason
    assert "".join(c for c in chunks if isinstance(c, str)) == (asked.choices[0].message.content or "").strip()


def test_closing_the_stream_closes_the_response(llm: OpenAIGenerator, server_log: Path) -> None:
    before = server_log.read_text(errors="replace").count("disconnected")
    stream = OpenAIGenerator.generate.chunks(llm, (QUESTIONS[0],), {"max_tokens": 400})
    assert next(stream)
    stream.close()
    deadline = time.monotonic() + 60  # the server notices at its next delta
    while server_log.read_text(errors="replace").count("disconnected") == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server_log.read_text(errors="replace").count("disconnected") > before, "the server saw no disconnect"
    assert same_opening(llm.generate(QUESTIONS[3]), local_answer(QUESTIONS[3]))  # it still serves


def test_a_prompt_past_the_context_is_a_value_error_and_the_server_keeps_serving(llm: OpenAIGenerator) -> None:
    with pytest.raises(ValueError, match="maximum context length is 2048 tokens.*shorten the question or the documents"):
        llm.generate("word " * 3000)
    assert same_opening(llm.generate(QUESTIONS[3]), local_answer(QUESTIONS[3]))  # it still serves


def test_a_failing_call_fails_alone_when_the_runtime_reruns_the_batch(llm: OpenAIGenerator) -> None:
    outcomes = run_batch(llm, "generate", [((QUESTIONS[1],), {}), (("word " * 3000,), {}), ((QUESTIONS[2],), {})])
    assert [ok for ok, _ in outcomes] == [True, False, True]
    assert isinstance(outcomes[1][1].error, ValueError)
    assert same_opening(outcomes[0][1], local_answer(QUESTIONS[1])) and same_opening(outcomes[2][1], local_answer(QUESTIONS[2]))


def test_an_unreachable_server_is_a_clear_error_at_setup() -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"
    message = f"cannot reach the OpenAI-compatible server at {url}/models: .*; start the server or fix base_url"
    with pytest.raises(ConnectionError, match=message):
        ensure_setup(OpenAIGenerator(url))


def test_a_base_url_that_is_not_an_http_url_fails_at_construction() -> None:
    for url in ("127.0.0.1:8080/v1", "ftp://127.0.0.1/v1", "http:///v1", "http://127.0.0.1:port/v1"):
        with pytest.raises(ValueError, match="base_url must be an http:// or https:// URL"):
            OpenAIGenerator(url)


def test_the_api_key_comes_from_the_argument_or_openai_api_key(base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match=f"{base_url}/models answered HTTP 401: .*Invalid API key.*set OPENAI_API_KEY"):
        ensure_setup(OpenAIGenerator(base_url))
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    keyed = OpenAIGenerator(base_url)
    ensure_setup(keyed)
    assert keyed.model == str(default_gguf_path())


@pytest.mark.parametrize("backend", ["local", "inprocess"])  # inprocess runs batches on its event loop's thread
def test_deployed_answers_equal_local_ones_and_a_failing_call_fails_alone(llm: OpenAIGenerator, backend: str) -> None:
    def answer(question: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return llm.generate(question)
        return pipeline

    answer("x")
    questions = [*QUESTIONS, "word " * 3000]
    with patchkit.deploy(patchkit.last_pipeline(), backend=backend) as endpoint, ThreadPoolExecutor(len(questions)) as pool:
        # Sent together, so the deployment may batch them; the overflowing one fails and only it.
        replies = [pool.submit(endpoint.query, question=q) for q in questions]
        answers = [r.result() for r in replies[:-1]]
        assert all(same_opening(a, local_answer(q)) for a, q in zip(answers, QUESTIONS)), answers
        with pytest.raises(patchkit.ComponentError, match="maximum context length"):
            replies[-1].result()
        assert same_opening(endpoint.query(question=QUESTIONS[0]), local_answer(QUESTIONS[0]))


def test_a_deployed_generator_given_no_key_reads_it_in_its_worker(base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)  # the worker's environment: it inherits this process's
    keyless = OpenAIGenerator(base_url, max_tokens=16, extra_body=SAME_SAMPLING)

    def answer(question: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return keyless.generate(question)
        return pipeline

    answer("x")
    with patchkit.deploy(patchkit.last_pipeline()) as endpoint:
        assert same_opening(endpoint.query(question=QUESTIONS[1]), local_answer(QUESTIONS[1]))


@pytest.mark.parametrize("backend", ["local", "inprocess"])
def test_a_deployed_streaming_request_gets_the_answer_delta_by_delta(llm: OpenAIGenerator, backend: str) -> None:
    def answer(question: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return llm.generate(question)
        return pipeline

    async def body(frontend: Frontend) -> tuple[list[str], Any]:
        deltas: list[str] = []
        result = await frontend.query({"question": QUESTIONS[0]}, on_delta=deltas.append)
        return deltas, result.output

    deltas, output = run_frontend(answer("x"), body, backend=backend)
    assert len(deltas) >= 2 and "".join(deltas) == output  # the async generator's chunks, as the server sent them
    assert same_opening(output, local_answer(QUESTIONS[0]))
