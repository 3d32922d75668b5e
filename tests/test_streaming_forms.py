"""A streaming request gets the output's text while it is being made, whatever form the output takes.

Every form a pipeline gives its output (a `return` in a function's capture, `output=` a name at
module level, a field of a dict output named by `chat_output`, at module and at function level),
on the inprocess and the local backend, through `POST /v1/query`, `Endpoint.stream` and the
`openai` SDK; and from a script run as `python app.py`, as users do. Beneath them: the pipeline a
front-end process loads (pickled) calls at the sites its graph names as streaming the output, and
on inprocess a streamed call runs off the loop and stops when its request ends.

`Streamer(ack_dir=...)` waits before its last word until the reader says it has the first one,
and names in that word whether it did ("read" or "unread"): an answer ending in "read" proves the
first chunk reached the client before the last was made, whatever the timings.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import httpx
import openai
import pytest
from components import Streamer
from serving import run_frontend

import patchkit
from patchkit import make
from patchkit.core import CallSite, Component, MakeMethod, call_hook
from patchkit.serving.frontend import Frontend

TESTS = Path(__file__).parent
ACKS = Path(tempfile.mkdtemp(prefix="patchkit-acks-"))  # the components' constructor argument: made at import

streamer = Streamer(ack_dir=str(ACKS))

question = "What is a generator?"
with patchkit.capture(run=False, output="answer") as module_answer:
    answer = streamer.generate(question)

with patchkit.capture(run=False, output="reply") as module_reply:
    reply = {"answer": streamer.generate(question), "question": question}


def function_answer() -> patchkit.Pipeline:
    question = "What is a generator?"
    with patchkit.capture(run=False) as pipeline:
        return streamer.generate(question)  # type: ignore[no-any-return]
    return pipeline


def function_reply() -> patchkit.Pipeline:
    question = "What is a generator?"
    with patchkit.capture(run=False) as pipeline:
        return {"answer": streamer.generate(question), "question": question}  # type: ignore[return-value]
    return pipeline


# form -> (the pipeline, the field of its dict output holding the answer)
FORMS: dict[str, tuple[Callable[[], patchkit.Pipeline], str | None]] = {
    "return": (function_answer, None),
    "output-name-module": (lambda: module_answer, None),
    "dict-field-module": (lambda: module_reply, "answer"),
    "dict-field-function": (function_reply, "answer"),
}
BACKENDS = [pytest.param("inprocess", id="inprocess"), pytest.param("local", id="local", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", autouse=True)
def _remove_acks() -> Iterator[None]:
    yield
    shutil.rmtree(ACKS, ignore_errors=True)


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module", params=list(FORMS))
def served(request: pytest.FixtureRequest, backend: str) -> Iterator[tuple[patchkit.Endpoint, str | None]]:
    pipeline, field = FORMS[request.param]
    with patchkit.deploy(pipeline(), backend=backend, chat_output=field) as endpoint:
        yield endpoint, field


def fresh_question() -> str:
    """A question of its own per request: its acknowledgement file is named after it."""
    return f"q{uuid.uuid4().hex}"


def acknowledge(question: str) -> None:
    (ACKS / question).touch()


def expected_answer(question: str) -> str:
    return f"Answer to {question} is read"


def check_streamed(chunks: list[str], answer: str, question: str) -> None:
    assert len(chunks) >= 2, f"the answer came in {len(chunks)} chunk(s): {chunks}"
    assert "".join(chunks) == answer
    assert answer == expected_answer(question), "the first chunk reached the client only once the answer was made"


def query_events(url: str, question: str) -> tuple[list[str], Any]:
    """The deltas of a streamed `/v1/query`, read as they arrive (the first acknowledged at once),
    and the output its final event carries; fails on an event after the final one but the terminal `event: end`."""
    deltas: list[str] = []
    final: dict[str, Any] | None = None
    ended = False
    body = {"inputs": {"question": question}, "stream": True}
    with httpx.stream("POST", url + "/v1/query", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            ended = ended or line == "event: end"
            if ended or not line.startswith("data: "):
                continue
            assert final is None, f"an event after the final one: {line}"
            event = json.loads(line.removeprefix("data: "))
            if "delta" in event:
                deltas.append(event["delta"])
                acknowledge(question)
            else:
                final = event
    assert final is not None and set(final) >= {"output", "request_id"} and ended
    return deltas, final["output"]


def answer_of(output: Any, field: str | None) -> str:
    if field is None:
        assert isinstance(output, str)
        return output
    assert isinstance(output, dict)
    return str(output[field])


@pytest.mark.parametrize("form", list(FORMS))
def test_a_pickled_pipeline_calls_at_the_sites_its_graph_names(form: str) -> None:
    """What a front-end finds the calls streaming the output by: the pipeline it loads (pickled, as
    deploy() sends it to a local or ray front-end) makes its calls at its graph's output sites."""
    pipeline = pickle.loads(cloudpickle.dumps(FORMS[form][0]()))
    sites = []

    def hook(
        component: Component, method: MakeMethod, args: tuple[Any, ...], kwargs: dict[str, Any], site: CallSite | None
    ) -> str:
        sites.append(site)
        return "text"

    with call_hook(hook):
        pipeline.run(pipeline.variables({}))
    assert len(sites) == 1 and sites[0] in pipeline.graph.output_sites()


def test_a_streamed_query_sends_the_output_as_it_is_made(served: tuple[patchkit.Endpoint, str | None]) -> None:
    endpoint, field = served
    question = fresh_question()
    deltas, output = query_events(endpoint.url, question)
    check_streamed(deltas, answer_of(output, field), question)
    if field is not None:
        assert output == {field: expected_answer(question), "question": question}


def test_endpoint_stream_yields_the_output_as_it_is_made(served: tuple[patchkit.Endpoint, str | None]) -> None:
    endpoint, field = served
    question = fresh_question()
    stream = endpoint.stream(question=question)
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        acknowledge(question)
    check_streamed(chunks, answer_of(stream.output, field), question)


def test_the_openai_sdk_streams_the_answer_as_it_is_made(served: tuple[patchkit.Endpoint, str | None]) -> None:
    endpoint, _ = served
    question = fresh_question()
    sdk = openai.OpenAI(base_url=endpoint.url + "/v1", api_key="x", max_retries=0)
    stream = sdk.chat.completions.create(model="patchkit", messages=[{"role": "user", "content": question}], stream=True)
    deltas = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            deltas.append(chunk.choices[0].delta.content)
            acknowledge(question)
    check_streamed(deltas, "".join(deltas), question)


class Talker(Component):
    """Says its text a word every 10 ms; counts the calls stopped before their end."""

    def setup(self) -> None:
        self.stopped = self.finished = 0

    @make(stream=True)
    def say(self, text: str) -> Iterator[str]:
        done = False
        try:
            for word in text.split():
                time.sleep(0.01)
                yield word + " "
            done = True
        finally:
            self.stopped += not done
            self.finished += done


def test_on_inprocess_a_request_that_ends_stops_its_streaming_call() -> None:
    """A streamed call runs off the loop there, as on a worker, and stops at its next chunk once its request ends."""
    talker = Talker()

    def talking(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return talker.say(text)  # type: ignore[no-any-return]
        return pipeline

    async def body(frontend: Frontend) -> tuple[int, int]:
        first = asyncio.Event()
        request = asyncio.ensure_future(frontend.query({"text": "w " * 3000}, on_delta=lambda _: first.set()))
        await asyncio.wait_for(first.wait(), 30)
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        for _ in range(500):
            if talker.stopped or talker.finished:
                break
            await asyncio.sleep(0.01)
        return talker.stopped, talker.finished

    assert run_frontend(talking("x"), body) == (1, 0)


SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    import patchkit
    from components import Streamer

    acks = sys.argv[1]
    llm = Streamer(ack_dir=acks)
    question = "What is a generator?"
    with patchkit.capture(run=False, output="answer") as pipeline:
        answer = llm.generate(question)

    with patchkit.deploy(pipeline) as endpoint:
        stream = endpoint.stream(question="first")
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            Path(acks, "first").touch()
    print(json.dumps({{"chunks": chunks, "output": stream.output}}))
    """
)


@pytest.mark.slow
def test_a_script_streams_its_module_level_pipeline_from_the_default_backend(tmp_path: Path) -> None:
    """`python app.py`: a capture in `__main__`, deployed on the default backend, streamed by `Endpoint.stream`."""
    script, acks = tmp_path / "app.py", tmp_path / "acks"
    acks.mkdir()
    script.write_text(SCRIPT.format(tests=str(TESTS)))
    done = subprocess.run([sys.executable, str(script), str(acks)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    check_streamed(result["chunks"], result["output"], "first")
