"""Request ids, streamed queries over server-sent events, and `Endpoint.stream`, on the inprocess backend.

(Every form of output, streamed on each backend: test_streaming_forms.py.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from components import Flaky, Streamer

import patchkit
from patchkit.client.streams import AsyncStream, ServerEvent, Step, Stream, sse_data, sse_events
from patchkit.errors import ComponentError
from patchkit.server.events import pump
from patchkit.server.request_ids import REQUEST_ID, RequestIdFilter, check_request_id

llm = Streamer()
flaky = Flaky()


def answer_pipeline() -> patchkit.Pipeline:
    question = "What is a generator?"
    with patchkit.capture(run=False) as pipeline:
        return llm.generate(question)  # type: ignore[no-any-return]
    return pipeline


def failing_pipeline() -> patchkit.Pipeline:
    text = "boom"
    with patchkit.capture(run=False) as pipeline:
        return flaky.check(text)  # type: ignore[no-any-return]
    return pipeline


@pytest.fixture(scope="module")
def endpoint() -> Iterator[patchkit.Endpoint]:
    answer_pipeline()
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess", slo_ms=60_000) as served:
        yield served


def events(response: httpx.Response) -> list[dict[str, object]]:
    return [json.loads(data) for data in sse_data(iter(response.text.splitlines()))]


def test_the_client_request_id_is_kept_in_header_body_and_traces(endpoint: patchkit.Endpoint) -> None:
    reply = httpx.post(endpoint.url + "/v1/query", json={"inputs": {"question": "q"}}, headers={"X-Request-ID": "trace-me 1"})
    assert reply.status_code == 200
    assert reply.headers["X-Request-ID"] == "trace-me 1" and reply.json()["request_id"] == "trace-me 1"
    assert "trace-me 1" in [trace.request_id for trace in endpoint.traces()]


def test_requests_without_an_id_get_fresh_unique_ones(endpoint: patchkit.Endpoint) -> None:
    replies = [httpx.post(endpoint.url + "/v1/query", json={"inputs": {"question": "q"}}) for _ in range(3)]
    ids = [reply.json()["request_id"] for reply in replies]
    assert len(set(ids)) == 3 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids)
    assert [reply.headers["X-Request-ID"] for reply in replies] == ids
    assert httpx.get(endpoint.url + "/healthz").headers["X-Request-ID"]


@pytest.mark.parametrize("given", ["x" * 201, "tab\there", "é"])
def test_a_bad_request_id_is_refused(endpoint: patchkit.Endpoint, given: str) -> None:
    reply = httpx.post(endpoint.url + "/v1/query", json={"inputs": {"question": "q"}}, headers={"X-Request-ID": given.encode()})
    assert reply.status_code == 400 and "X-Request-ID" in reply.json()["error"]["message"]
    assert reply.json()["request_id"] == reply.headers["X-Request-ID"] != given


def test_errors_and_their_log_lines_carry_the_request_id(endpoint: patchkit.Endpoint, caplog: pytest.LogCaptureFixture) -> None:
    caplog.handler.addFilter(RequestIdFilter())
    with caplog.at_level(logging.WARNING, logger="patchkit.server.http"):
        reply = httpx.post(endpoint.url + "/v1/query", json={"inputs": {"nope": 1}}, headers={"X-Request-ID": "bad-input-7"})
    assert reply.status_code == 400 and reply.json()["request_id"] == "bad-input-7"
    assert [r.request_id for r in caplog.records if "nope" in r.getMessage()] == ["bad-input-7"]  # type: ignore[attr-defined]


def test_the_log_filter_stamps_the_current_request() -> None:
    record = logging.LogRecord("patchkit", logging.INFO, __file__, 1, "x", None, None)
    token = REQUEST_ID.set("r-1")
    try:
        assert RequestIdFilter().filter(record) and record.request_id == "r-1"  # type: ignore[attr-defined]
    finally:
        REQUEST_ID.reset(token)
    assert check_request_id("a" * 200) == "a" * 200


def test_a_streamed_query_ends_with_the_non_streamed_reply(endpoint: patchkit.Endpoint) -> None:
    plain = httpx.post(endpoint.url + "/v1/query", json={"inputs": {"question": "What is x?"}}).json()
    with httpx.stream("POST", endpoint.url + "/v1/query", json={"inputs": {"question": "What is x?"}, "stream": True},
                      headers={"X-Request-ID": "s-1"}) as response:
        response.read()
    assert response.headers["content-type"].startswith("text/event-stream") and response.headers["X-Request-ID"] == "s-1"
    *deltas, final, end = events(response)
    assert len(deltas) >= 2 and all(set(d) == {"delta"} for d in deltas)  # a word at a time, not the answer at once
    assert "".join(str(d["delta"]) for d in deltas) == final["output"] == plain["output"] and final["request_id"] == "s-1"
    assert end == {"request_id": "s-1", "status": "ok"}
    names = [event.event for event in sse_events(iter(response.text.splitlines()))]
    assert names == ["message"] * (len(deltas) + 1) + ["end"]  # deltas and the reply unnamed, as before


def test_endpoint_stream_chunks_add_up_to_the_output(endpoint: patchkit.Endpoint) -> None:
    expected = endpoint.query(question="What is y?")
    stream = endpoint.stream(question="What is y?")
    assert "".join(stream) == expected and stream.output == expected and stream.request_id

    async def collect() -> tuple[str, object]:
        astream = endpoint.astream(question="What is y?")
        return "".join([chunk async for chunk in astream]), astream.output

    assert asyncio.run(collect()) == (expected, expected)


def test_a_stream_that_fails_before_its_first_event_is_a_json_error() -> None:
    failing_pipeline()
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess") as served:
        reply = httpx.post(served.url + "/v1/query", json={"inputs": {"text": "fail now"}, "stream": True})
        assert reply.status_code == 500 and reply.json()["error"]["type"] == "ComponentError"
        with pytest.raises(ComponentError, match="cannot check"):
            list(served.stream(text="fail now"))


def test_stream_must_be_a_boolean(endpoint: patchkit.Endpoint) -> None:
    reply = httpx.post(endpoint.url + "/v1/query", json={"inputs": {"question": "q"}, "stream": "yes"})
    assert reply.status_code == 400 and "stream must be true or false" in reply.json()["error"]["message"]


def test_pump_hands_on_every_chunk_before_the_result() -> None:
    async def run(report: object) -> str:
        assert callable(report)
        for chunk in ["a", "b"]:
            report(chunk)
            await asyncio.sleep(0)
        report("c")  # reported just before the end: still handed on
        return "abc"

    async def main() -> tuple[list[str], str]:
        seen: list[str] = []

        async def on_delta(chunk: str) -> None:
            seen.append(chunk)

        return seen, await pump(run, on_delta)

    assert asyncio.run(main()) == (["a", "b", "c"], "abc")


def test_pump_cancels_the_request_when_the_client_is_gone() -> None:
    async def main() -> bool:
        started = asyncio.Event()
        task_holder: list[asyncio.Task[None]] = []

        async def run(report: object) -> None:
            task_holder.append(asyncio.current_task())  # type: ignore[arg-type]
            assert callable(report)
            report("x")
            started.set()
            await asyncio.sleep(60)

        async def on_delta(chunk: str) -> None:
            raise ConnectionResetError("gone")

        with pytest.raises(ConnectionResetError):
            await pump(run, on_delta)
        await asyncio.sleep(0)
        return task_holder[0].cancelled()

    assert asyncio.run(main())


def test_sse_data_joins_multi_line_events() -> None:
    assert list(sse_data(iter(["data: a", "data: b", "", ": comment", "data: [DONE]"]))) == ["a\nb", "[DONE]"]


def test_sse_events_read_each_events_name() -> None:
    lines = ["event: step", "data: 1", "", ": a comment", "data:2", "id: 7", "", "event: end", "", "event: end", "data: 3"]
    assert list(sse_events(iter(lines))) == [ServerEvent("step", "1"), ServerEvent("message", "2"),
                                             ServerEvent("end", "3")]  # an event with no data is none


WIRE = (b'data: {"delta": "Hi"}\n\nevent: step\ndata: {"step": {"phase": "start", "call": 0, "node": "n0", '
        b'"component": "llm", "method": "generate", "at_ms": 0.1, "new_field": 1}}\n\n'
        b'data: {"output": "Hi!", "request_id": "r-1", "latency_ms": 2.0}\n\n'
        b'event: end\ndata: {"request_id": "r-1", "status": "ok"}\n\n'
        b'data: {"delta": "after the end"}\n\n')


def _wire(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=WIRE)


def test_both_streams_read_named_events_and_stop_at_the_end() -> None:
    client = httpx.Client(transport=httpx.MockTransport(_wire))
    stream: Stream[object] = Stream(lambda: client.stream("POST", "http://patchkit.test/v1/query"), lambda r: r.json())
    items = list(stream)
    assert items[0] == "Hi" and isinstance(items[1], Step) and items[2:] == ["!"]  # nothing read past the end
    assert items[1].extra == {"new_field": 1} and stream.output == "Hi!" and stream.request_id == "r-1"

    async def read() -> list[object]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(_wire)) as aclient:
            astream: AsyncStream[object] = AsyncStream(lambda: aclient.stream("POST", "http://patchkit.test/v1/query"),
                                                       lambda r: r.json())
            return [item async for item in astream]

    assert asyncio.run(read()) == items


@pytest.mark.slow
def test_the_front_end_process_logs_name_the_request(capfd: pytest.CaptureFixture[str]) -> None:
    answer_pipeline()
    with patchkit.deploy(patchkit.last_pipeline(), log_level="warning") as served:
        reply = httpx.post(served.url + "/v1/query", json={"inputs": {"nope": 1}}, headers={"X-Request-ID": "log-me-3"})
        assert reply.status_code == 400
        stream = served.stream(question="What is z?")
        assert "".join(stream) == served.query(question="What is z?") == stream.output
    line = next(line for line in capfd.readouterr().err.splitlines() if "nope" in line)
    assert "front-end patchkit.server.http [log-me-3]: POST /v1/query: 400" in line


def slow_pipeline(slow: Streamer) -> patchkit.Pipeline:
    question = "long"
    with patchkit.capture(run=False) as pipeline:
        return slow.generate(question)  # type: ignore[no-any-return]
    return pipeline


def test_leaving_an_astream_early_closes_it_and_cancels_the_request(tmp_path: Path) -> None:
    slow_pipeline(Streamer(str(tmp_path), wait_s=5.0))  # its last word waits for a file nobody writes
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess") as served:

        async def first_chunk() -> str:
            async with served.astream(question="long") as stream:
                async for chunk in stream:
                    return chunk
            return ""

        loop = asyncio.new_event_loop()  # closed right after, as a notebook's or a framework's loop may be
        try:
            assert loop.run_until_complete(first_chunk()) == "Answer"
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()
        deadline = time.monotonic() + 10
        while served.stats()["requests"].get("cancelled", 0) < 1:
            assert time.monotonic() < deadline, served.stats()["requests"]
            time.sleep(0.05)
        assert served.stats()["requests"]["inflight"] == 0
