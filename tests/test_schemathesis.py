"""`GET /openapi.json` agrees with the server: Schemathesis, run as its command line runs it (every phase: examples,
coverage, fuzzing, stateful; every check), finds no request the document allows that the server refuses, none it
forbids that the server takes, and no reply, status, header or streamed event the document does not describe.

Against one pipeline whose inputs are a str, an int, a list and a dict (the chat API on too), two pipelines behind
a bearer token with step previews on, and two whose answering calls honour sampling options (one of a dict output
of several fields, one with an input named like an option) with step events off, each on the inprocess backend.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from components import Streamer

import patchkit
from patchkit import Component, make
from patchkit.core.options import CallOptions

pytest.importorskip("schemathesis", reason="the document is checked with Schemathesis (the test extra)")

MAX_EXAMPLES = 25  # per operation and phase: the three runs take about 20 s together
SEED = 58  # the same cases on every run; a failure's output names its seed and a command that repeats it


class Librarian(Component):
    @make(read_only=True)
    def answer(self, question: str, count: int, tags: list[Any], meta: dict[str, Any]) -> str:
        return f"{question[:40]} x{count}: {len(tags)} tags, {sorted(map(str, meta))[:3]}"


class Echo(Component):
    """Streams its prompt back word by word, honouring max_tokens and stop as a model does."""

    honoured_options = frozenset({"max_tokens", "stop"})

    @make(stream=True, read_only=True)
    def generate(self, prompt: str, options: CallOptions | None = None) -> Iterator[str]:
        options = options or CallOptions()
        for word in prompt.split()[: options.max_tokens]:
            if word in options.stop:
                return
            yield word + " "


class Tuned(Component):
    @make(read_only=True)
    def answer(self, question: str, temperature: float) -> str:
        return f"{question[:20]} at {temperature}"


librarian, writer, echo, tuned = Librarian(), Streamer(), Echo(), Tuned()


def notes() -> patchkit.Pipeline:
    question, count, tags, meta = "What is a list?", 2, ["python"], {"level": 1}
    with patchkit.capture(run=False) as pipeline:
        answer = librarian.answer(question, count, tags, meta)  # noqa: F841 - the block's output
    return pipeline


def ledger() -> patchkit.Pipeline:
    prompt = "a ledger"
    with patchkit.capture(run=False) as pipeline:
        answer = writer.generate(prompt)  # noqa: F841 - the block's output
    return pipeline


def drafts() -> patchkit.Pipeline:
    question = "q"
    with patchkit.capture(run=False) as pipeline:
        draft = echo.generate("one two three")
        answer = {"answer": echo.generate(question + " " + draft), "draft": draft}  # noqa: F841 - the block's output
    return pipeline


def tuning() -> patchkit.Pipeline:
    question, temperature = "q", 0.5
    with patchkit.capture(run=False) as pipeline:
        answer = tuned.answer(question, temperature)  # noqa: F841 - the block's output
    return pipeline


def schemathesis(url: str, *headers: str) -> subprocess.CompletedProcess[str]:
    """Schemathesis's command line, run in a directory of its own (it keeps a cache where it runs)."""
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all",
               "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED), "--no-color"]
    for header in headers:
        command += ["--header", header]
    with tempfile.TemporaryDirectory() as directory:
        return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=directory)


@pytest.fixture(scope="module")
def one() -> Iterator[patchkit.Endpoint]:
    with patchkit.deploy(notes(), backend="inprocess", chat_input="question") as served:
        yield served


@pytest.fixture(scope="module")
def two() -> Iterator[patchkit.Endpoint]:
    pipelines = {"notes": notes(), "ledger": ledger()}
    with patchkit.deploy(pipelines, backend="inprocess", auth_token="s3cret", chat_input="question",
                         steps="previews") as served:
        yield served


@pytest.fixture(scope="module")
def fields() -> Iterator[patchkit.Endpoint]:
    with patchkit.deploy({"drafts": drafts(), "tuning": tuning()}, backend="inprocess", chat_input="question",
                         chat_output="answer", steps="off", optional_inputs=("temperature",)) as served:
        yield served


def assert_passed(run: subprocess.CompletedProcess[str]) -> None:
    assert run.returncode == 0, run.stdout[-20_000:] + run.stderr[-5_000:]
    for phase in ("Coverage", "Fuzzing", "Stateful"):
        assert f"✅ {phase}" in run.stdout, run.stdout[-5_000:]


def test_schemathesis_finds_nothing_against_one_pipeline_of_every_input_kind(one: patchkit.Endpoint) -> None:
    assert_passed(schemathesis(one.url))


def test_schemathesis_finds_nothing_against_two_pipelines_behind_a_token(two: patchkit.Endpoint) -> None:
    assert_passed(schemathesis(two.url, "Authorization: Bearer s3cret"))


def test_schemathesis_finds_nothing_against_dict_outputs_options_and_steps_off(fields: patchkit.Endpoint) -> None:
    assert_passed(schemathesis(fields.url))


def test_the_chat_body_is_the_one_the_server_checks(one: patchkit.Endpoint) -> None:
    served = httpx.get(f"{one.url}/openapi.json").json()
    chat = served["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["required"] == ["messages"] and chat["additionalProperties"] is False
    assert chat["properties"]["messages"]["minItems"] == 1 and chat["properties"]["messages"]["contains"]
    assert chat["properties"]["count"] == {"anyOf": [{"type": "integer"}, {"type": "null"}]}  # an input of its name
    assert chat["properties"]["temperature"]["type"] == "null"  # no call that answers honours it
    assert httpx.post(f"{one.url}/v1/chat/completions", json={}).status_code == 400
    reply = httpx.post(f"{one.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"].startswith("hi x2")
    query = served["paths"]["/v1/query"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert query["properties"]["slo_ms"]["exclusiveMinimum"] == 0
    assert httpx.post(f"{one.url}/v1/query", json={"inputs": {}, "slo_ms": 0}).status_code == 400
