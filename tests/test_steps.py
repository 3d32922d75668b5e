"""Step events: a streamed request's component calls, each reported as it starts and as it ends, as named SSE
events (`event: step`), then the stream's terminal `event: end`; what they show is the deployment's `steps` option.
On the default backend (worker processes, so those tests are slow) and on the inprocess one, with simulated
components."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from components import Flaky, Streamer, Vault

import patchkit
from patchkit.client.streams import ServerEvent, Step, sse_events
from patchkit.components.testing import Simulated
from patchkit.errors import ComponentError
from patchkit.serving.steps import PreviewLimits, RequestSteps, preview_of

retriever = Simulated(5, output=lambda q: [f"a page about {q}", "the tutorial"])
vault = Vault()
llm = Streamer()
flaky = Flaky()
CALLS = ["retriever.run", "vault.lookup", "llm.generate"]  # the order the rag pipeline makes its calls


def rag() -> str:
    question = "How do I catch an exception?"
    with patchkit.capture():
        docs = retriever.run(question)
        key = vault.lookup(question)
        return llm.generate(question + " " + key + " " + docs[1])  # type: ignore[no-any-return]


def check() -> str:
    text = "hello"
    with patchkit.capture():
        return flaky.check(text)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def endpoint() -> Iterator[patchkit.Endpoint]:
    rag()
    answering = patchkit.last_pipeline()
    check()
    with patchkit.deploy({"rag": answering, "check": patchkit.last_pipeline()}, steps="previews") as served:
        yield served


def named_events(endpoint: patchkit.Endpoint, path: str, body: dict[str, Any]) -> list[ServerEvent]:
    """The stream's events, by name, as the client's parser reads them and as a plain reading of the text does (blocks
    split at blank lines); checked to end with `event: end`. (test_schemathesis.py has Schemathesis's parser read
    the streams too, each event checked against the document.)"""
    reply = httpx.post(endpoint.url + path, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream")
    sent = list(sse_events(iter(reply.text.splitlines())))
    assert reply.text.endswith("\n\n") and [(e.event, e.data) for e in sent] == plain_reading(reply.text)
    assert sent[-1].event == "end"
    end = json.loads(sent[-1].data)
    assert end["request_id"] == reply.headers["X-Request-ID"] and end["status"] in ("ok", "error")
    return sent


def plain_reading(text: str) -> list[tuple[str, str]]:
    """(name, data) of each event of a stream whose events each hold at most an `event:` line and `data:` lines."""
    read = []
    for block in text.removesuffix("\n\n").split("\n\n"):
        lines = block.split("\n")
        name = lines[0].removeprefix("event: ") if lines[0].startswith("event: ") else "message"
        read.append((name, "\n".join(line.removeprefix("data: ") for line in lines if line.startswith("data: "))))
    return read


def events(endpoint: patchkit.Endpoint, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The data of every event but the terminal `end`; each step's only in an `event: step`, the rest unnamed but
    for an `event: error`."""
    sent = named_events(endpoint, path, body)[:-1]
    for event in sent:
        data = json.loads(event.data)
        assert event.event == ("step" if "step" in data else "error" if "error" in data else "message"), event
    return [json.loads(event.data) for event in sent]


def assert_in_order(steps: list[dict[str, Any]], calls: list[str]) -> None:
    """Each call a start then an end, started in the order made, every end after its start."""
    starts = [s for s in steps if s["phase"] == "start"]
    assert [f"{s['component']}.{s['method']}" for s in starts] == calls
    assert [s["call"] for s in starts] == list(range(len(calls)))
    for number in range(len(calls)):
        mine = [s for s in steps if s["call"] == number]
        assert [s["phase"] for s in mine] == ["start", "end"]
        start, end = mine
        assert end["at_ms"] >= start["at_ms"] and end["duration_ms"] >= end["wait_ms"] >= 0
        assert end["batch"] >= 1 and end["replica"].startswith(start["component"])
        assert start["node"] == end["node"] is not None


@pytest.mark.slow  # worker processes
def test_every_call_starts_and_ends_in_order_among_the_tokens(endpoint: patchkit.Endpoint) -> None:
    question = "What is a decorator?"
    sent = events(endpoint, "/v1/pipelines/rag/query", {"inputs": {"question": question}, "stream": True, "steps": True})
    kinds = [next(iter(event)) for event in sent]
    assert kinds[-1] == "output" and set(kinds[:-1]) == {"step", "delta"}
    steps = [event["step"] for event in sent if "step" in event]
    assert_in_order(steps, CALLS)
    # the answer's tokens come after its call started and before it ended
    generate = [i for i, event in enumerate(sent) if event.get("step", {}).get("component") == "llm"]
    deltas = [i for i, event in enumerate(sent) if "delta" in event]
    assert generate[0] < deltas[0] and deltas[-1] < generate[1]
    assert "".join(sent[i]["delta"] for i in deltas) == sent[-1]["output"]
    retrieved = next(s for s in steps if s["phase"] == "end" and s["component"] == "retriever")
    assert retrieved["preview"] == [f"a page about {question}", "the tutorial"]
    assert retrieved["preview_truncated"] is False
    graph = httpx.get(endpoint.url + "/v1/pipelines/rag/graph").json()
    assert {s["node"] for s in steps} <= {node["id"] for node in graph["nodes"]}


@pytest.mark.slow  # worker processes
def test_without_the_opt_in_the_stream_is_the_same_less_its_steps(endpoint: patchkit.Endpoint) -> None:
    body = {"inputs": {"question": "What is a list?"}, "stream": True}
    plain = events(endpoint, "/v1/pipelines/rag/query", body)
    with_steps = events(endpoint, "/v1/pipelines/rag/query?steps=true", body)
    assert any("step" in event for event in with_steps)
    without = [event for event in with_steps if "step" not in event]
    assert [set(event) for event in plain] == [set(event) for event in without]
    assert [event.get("delta") for event in plain] == [event.get("delta") for event in without]
    assert plain[-1]["output"] == without[-1]["output"]
    assert all(set(event) in ({"delta"}, {"output", "request_id", "latency_ms"}) for event in plain)


@pytest.mark.slow  # worker processes
def test_a_failed_call_ends_with_its_error(endpoint: patchkit.Endpoint) -> None:
    sent = events(endpoint, "/v1/pipelines/check/query", {"inputs": {"text": "please fail"}, "stream": True, "steps": True})
    steps = [event["step"] for event in sent if "step" in event]
    assert [s["phase"] for s in steps] == ["start", "end"]
    assert steps[1]["error"]["type"] == "ValueError" and "cannot check 'please fail'" in steps[1]["error"]["message"]
    assert "preview" not in steps[1]
    assert "error" in sent[-1]


@pytest.mark.slow  # worker processes
def test_a_sensitive_component_shows_no_preview(endpoint: patchkit.Endpoint) -> None:
    question = "Where is the key?"
    steps = [s for s in endpoint["rag"].stream(question=question, steps=True) if isinstance(s, Step)]
    lookup = next(s for s in steps if s.component == "vault" and s.phase == "end")
    assert lookup.sensitive and lookup.preview is None and lookup.error is None
    assert f"secret-{len(question)}" not in json.dumps([s.__dict__ for s in steps if s.component == "vault"])
    assert next(s for s in steps if s.component == "retriever" and s.phase == "end").preview


@pytest.mark.slow  # worker processes
def test_the_clients_yield_steps_among_the_text(endpoint: patchkit.Endpoint) -> None:
    stream = endpoint["rag"].stream(question="What is a tuple?", steps=True)
    items = list(stream)
    text = "".join(item for item in items if isinstance(item, str))
    assert text == stream.output and stream.steps == [item for item in items if isinstance(item, Step)]
    assert_in_order([s.__dict__ for s in stream.steps], CALLS)

    async def read() -> list[Any]:
        astream = endpoint["rag"].astream(question="What is a set?", steps=True)
        return [item async for item in astream]

    items = asyncio.run(read())
    assert_in_order([item.__dict__ for item in items if isinstance(item, Step)], CALLS)
    plain = list(endpoint["rag"].stream(question="What is a set?"))
    assert all(isinstance(item, str) for item in plain)


@pytest.mark.slow  # worker processes
def test_steps_need_a_stream(endpoint: patchkit.Endpoint) -> None:
    for path, body in (("/v1/pipelines/rag/query", {"inputs": {"question": "q"}, "steps": True}),
                       ("/v1/pipelines/rag/query?steps=true", {"inputs": {"question": "q"}})):
        reply = httpx.post(endpoint.url + path, json=body)
        assert reply.status_code == 400 and "stream" in reply.json()["error"]["message"]


@pytest.mark.slow  # worker processes
def test_recent_requests_keep_their_calls_timings(endpoint: patchkit.Endpoint) -> None:
    endpoint["rag"].query(question="What is a dict?")
    recent = httpx.get(endpoint.url + "/v1/activity").json()["requests"]
    last = next(r for r in recent if r["pipeline"] == "rag")
    assert last["outcome"] == "ok" and [c["component"] for c in last["calls"]] == ["retriever", "vault", "llm"]
    assert all(c["duration_ms"] is not None and c["replica"] for c in last["calls"])
    assert "preview" not in json.dumps(recent)


def test_a_preview_is_json_cut_by_structure() -> None:
    @dataclasses.dataclass
    class Page:
        text: str
        tags: set[str]

    limits = PreviewLimits(chars=12, items=3, keys=2, depth=2)
    cases: list[tuple[Any, Any, bool]] = [
        ("x" * 50, "x" * 12, True),
        ([1, 2, 3, 4, 5], [1, 2, 3], True),
        ({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 2}, True),
        ([[["deep"]]], [[[]]], True),
        (Page("the text", {"b", "a"}), {"text": "the text", "tags": ["a", "b"]}, False),
        ({1: b"raw", None: math.nan}, {"1": "<bytes>", "null": "NaN"}, False),
        (("ab", "cdefghijklmnop"), ["ab", "cdefghijkl"], True),
        (object(), "<object>", False),
        (None, None, False),
    ]
    for value, shown, cut in cases:
        preview, truncated = preview_of(value, limits)
        assert (preview, truncated) == (shown, cut), value
        assert json.loads(json.dumps(preview, allow_nan=False)) == preview  # JSON, never a repr


def test_a_preview_shows_only_the_rows_of_an_array_it_can_hold() -> None:
    numpy = pytest.importorskip("numpy")
    preview, truncated = preview_of(numpy.arange(10_000).reshape(1000, 10), PreviewLimits(items=2))
    assert preview == [[0, 1], [10, 11]] and truncated


def test_an_end_event_carries_a_preview_only_where_previews_are_offered() -> None:
    for previews in (True, False):
        sent: list[Any] = []
        steps = RequestSteps("r1", "rag", "1-abc", sent.append, previews=previews, limits=PreviewLimits(chars=10))
        step = steps.start("n0", "llm", "generate", sensitive=False)
        steps.end(step, batch=3, replica="llm#1", wait_s=0.002, result={"answer": "x" * 50})
        secret = steps.start("n1", "vault", "lookup", sensitive=True)
        steps.end(secret, batch=1, replica="vault#0", wait_s=0.0, result="secret")
        assert [event["phase"] for event in sent] == ["start", "end", "start", "end"]
        assert sent[1]["batch"] == 3 and sent[1]["replica"] == "llm#1" and sent[1]["wait_ms"] == 2.0
        if previews:
            assert sent[1]["preview"] == {"answer": "x" * 10} and sent[1]["preview_truncated"] is True
        else:
            assert "preview" not in sent[1] and "preview_truncated" not in sent[1]
        assert sent[3]["sensitive"] is True and "preview" not in sent[3]
        json.dumps(sent, allow_nan=False)


def quick(steps: str | None) -> patchkit.Endpoint:
    """The rag pipeline on the inprocess backend, its `steps` option as given (None: the default)."""
    rag()
    return patchkit.deploy(patchkit.last_pipeline(), backend="inprocess", **({} if steps is None else {"steps": steps}))


def test_by_default_a_client_gets_step_timings_and_no_preview() -> None:
    body = {"inputs": {"question": "What is a list?"}, "stream": True, "steps": True}
    with quick(None) as endpoint:
        sent = events(endpoint, "/v1/query", body)
        plain = events(endpoint, "/v1/query", {**body, "steps": False})
    steps = [event["step"] for event in sent if "step" in event]
    assert_in_order(steps, CALLS)
    assert not any("preview" in step or "preview_truncated" in step for step in steps)
    deltas = [event for event in sent if "delta" in event]
    assert deltas == [event for event in plain if "delta" in event] and deltas  # the text deltas as before
    assert sent[-1]["output"] == plain[-1]["output"] == "".join(d["delta"] for d in deltas)


def test_where_steps_are_off_asking_for_them_is_a_400_naming_the_option() -> None:
    with quick("off") as endpoint:
        for path, body in (("/v1/query", {"inputs": {"question": "q"}, "stream": True, "steps": True}),
                           ("/v1/query?steps=true", {"inputs": {"question": "q"}, "stream": True})):
            reply = httpx.post(endpoint.url + path, json=body)
            assert reply.status_code == 400 and 'steps is "off"' in reply.json()["error"]["message"], reply.text
        with pytest.raises(patchkit.errors.InputError, match="steps"):
            list(endpoint.stream(question="q", steps=True))
        sent = events(endpoint, "/v1/query", {"inputs": {"question": "q"}, "stream": True})  # streams are as before
        assert sent[-1]["output"] and not any("step" in event for event in sent)


def test_with_previews_each_is_json_and_a_sensitive_call_shows_none() -> None:
    with quick("previews") as endpoint:
        sent = events(endpoint, "/v1/query", {"inputs": {"question": "Where?"}, "stream": True, "steps": True})
        stream = endpoint.stream(question="Where?", steps=True)
        items = list(stream)
    ends = {event["step"]["component"]: event["step"] for event in sent if event.get("step", {}).get("phase") == "end"}
    assert ends["retriever"]["preview"] == ["a page about Where?", "the tutorial"]
    assert ends["llm"]["preview_truncated"] is False and isinstance(ends["llm"]["preview"], str)
    assert ends["vault"]["sensitive"] is True and "preview" not in ends["vault"]
    assert "secret-" not in json.dumps(ends["vault"])
    steps = [item for item in items if isinstance(item, Step)]
    assert steps == stream.steps and next(s for s in steps if s.component == "retriever" and s.phase == "end").preview
    assert "".join(item for item in items if isinstance(item, str)) == stream.output


def test_an_error_after_the_stream_began_is_an_error_event_then_the_end() -> None:
    check()
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess") as endpoint:
        body = {"inputs": {"text": "please fail"}, "stream": True, "steps": True}
        sent = named_events(endpoint, "/v1/query", body)
        with pytest.raises(ComponentError, match="cannot check"):
            list(endpoint.stream(text="please fail", steps=True))
    assert [event.event for event in sent] == ["step", "step", "error", "end"]
    assert json.loads(sent[1].data)["step"]["error"]["type"] == "ValueError"
    error = json.loads(sent[2].data)
    assert error["error"]["type"] == "ComponentError" and error["request_id"] == json.loads(sent[3].data)["request_id"]
    assert json.loads(sent[3].data)["status"] == "error"
