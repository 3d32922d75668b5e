"""Step events: a streamed request's component calls, each reported as it starts and as it ends, on the
default backend (worker processes, so those tests are slow) with simulated components."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from components import Flaky, Streamer, Vault

import patchkit
from patchkit.client.streams import Step, sse_data
from patchkit.components.testing import Simulated

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
    with patchkit.deploy({"rag": answering, "check": patchkit.last_pipeline()}) as served:
        yield served


def events(endpoint: patchkit.Endpoint, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    reply = httpx.post(endpoint.url + path, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.headers["content-type"].startswith("text/event-stream")
    return [json.loads(data) for data in sse_data(iter(reply.text.splitlines()))]


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
    assert retrieved["preview"] == repr([f"a page about {question}", "the tutorial"])
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


def test_a_preview_is_cut_to_step_preview_chars() -> None:
    from patchkit.serving.steps import RequestSteps

    for size, shown in ((10, "x" * 9 + "\u2026"), (100, "x" * 50), (0, None)):
        sent: list[dict[str, Any]] = []
        steps = RequestSteps("r1", "rag", "1-abc", sent.append, preview_chars=size)
        step = steps.start("n0", "llm", "generate", sensitive=False)
        steps.end(step, batch=3, replica="llm#1", wait_s=0.002, result="x" * 50)
        assert [event["phase"] for event in sent] == ["start", "end"]
        assert sent[1].get("preview") == shown and sent[1]["batch"] == 3 and sent[1]["replica"] == "llm#1"
        assert sent[1]["wait_ms"] == 2.0
