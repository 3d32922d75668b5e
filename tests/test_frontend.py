"""The front-end on the inprocess backend: batching, pipelining, many requests in flight, the HTTP API."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from components import Flaky, Generator, Grader, Retriever
from corpus import CASES, Case
from serving import metric, run_frontend
from test_capture_corpus import _capture as capture_case

import patchkit
from patchkit import Component, make
from patchkit.config import DeploymentConfig
from patchkit.orchestrator.resources import SHARES_PER_CORE
from patchkit.server.inputs import InputSchema
from patchkit.serving.frontend import Frontend


class Recorder(Component):
    """Remembers the size of every batch it ran."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    @make(batch=True)
    def tag(self, text: list[str]) -> list[str]:
        self.batches.append(len(text))
        return [f"<{t}>" for t in text]


retriever, grader, llm, flaky, recorder = Retriever(topk=2), Grader(), Generator(), Flaky(), Recorder()


def crag(query: str) -> patchkit.Pipeline:
    with patchkit.capture() as pipeline:
        docs = retriever.retrieve(query)
        if not grader.grade(query, docs):
            docs = retriever.retrieve(llm.rewrite(query))
        return llm.generate(query, docs)
    return pipeline


def tagged(query: str) -> patchkit.Pipeline:
    with patchkit.capture() as pipeline:
        return recorder.tag(query)
    return pipeline


def checked(query: str) -> patchkit.Pipeline:
    with patchkit.capture() as pipeline:
        return flaky.check(query)
    return pipeline


def captured(fn: Any, query: str = "How do I catch an exception?") -> patchkit.Pipeline:
    fn(query)
    return patchkit.last_pipeline()


# -- batching and concurrency -------------------------------------------------------------------
def test_concurrent_requests_share_batches_up_to_the_batch_size() -> None:
    pipeline = captured(tagged)
    recorder.batches.clear()

    async def body(frontend: Frontend) -> list[Any]:
        return await asyncio.gather(*(frontend.query({"query": f"q{i}"}) for i in range(20)))

    results = run_frontend(pipeline, body, batch_size=8)
    assert [r.output for r in results] == [f"<q{i}>" for i in range(20)]
    assert max(recorder.batches) == 8
    assert sum(recorder.batches) == 20
    assert len(recorder.batches) < 20


def test_a_partial_batch_waits_for_more_calls_then_leaves_on_its_own() -> None:
    pipeline = captured(tagged)
    recorder.batches.clear()

    async def body(frontend: Frontend) -> list[str]:
        first = [asyncio.ensure_future(frontend.query({"query": f"a{i}"})) for i in range(3)]
        await asyncio.sleep(0.01)  # well inside the batch wait: nothing has left yet
        assert recorder.batches == []
        later = [asyncio.ensure_future(frontend.query({"query": f"b{i}"})) for i in range(2)]
        done = await asyncio.gather(*first, *later)
        return [r.output for r in done]

    outputs = run_frontend(pipeline, body, batch_size=16, batch_wait_ms=200)
    assert outputs == ["<a0>", "<a1>", "<a2>", "<b0>", "<b1>"]
    assert recorder.batches == [5]


def test_two_thousand_requests_wait_in_flight_without_a_thread_each() -> None:
    pipeline = captured(tagged)
    recorder.batches.clear()
    threads_before = threading.active_count()
    seen: dict[str, int] = {}

    async def body(frontend: Frontend) -> list[Any]:
        tasks = [asyncio.ensure_future(frontend.query({"query": str(i)})) for i in range(2000)]
        while frontend.inflight < 2000:
            await asyncio.sleep(0.01)
        seen["inflight"], seen["threads"] = frontend.inflight, threading.active_count()
        return await asyncio.gather(*tasks)

    results = run_frontend(pipeline, body, batch_size=2000, batch_wait_ms=60_000)
    assert seen["inflight"] == 2000
    assert seen["threads"] <= threads_before + 1
    assert [r.output for r in results] == [f"<{i}>" for i in range(2000)]
    assert recorder.batches == [2000]


def test_requests_at_different_stages_overlap() -> None:
    pipeline = captured(crag)
    queries = ["How do I catch an exception?", "Tell me about nothing in particular", "What is a generator?"] * 10

    async def body(frontend: Frontend) -> list[Any]:
        return await asyncio.gather(*(frontend.query({"query": q}) for q in queries))

    results = run_frontend(pipeline, body)
    assert [r.output for r in results] == [pipeline(query=q) for q in queries]


def test_calls_spread_over_replicas() -> None:
    pipeline = captured(tagged)

    async def body(frontend: Frontend) -> dict[str, Any]:
        await asyncio.gather(*(frontend.query({"query": str(i)}) for i in range(64)))
        return frontend.stats()

    stats = run_frontend(pipeline, body, replicas=2, batch_size=4, max_inflight_batches=1)
    replicas = stats["components"]["recorder"]["replicas"]
    assert len(replicas) == 2
    assert stats["components"]["recorder"]["methods"]["tag"]["calls"] == 64


# -- configuration ------------------------------------------------------------------------------
def test_config_names_unknown_components_with_a_suggestion() -> None:
    pipeline = captured(crag)
    with pytest.raises(patchkit.ConfigError, match="'retreiver'.*did you mean 'retriever'"):
        DeploymentConfig.resolve(pipeline, replicas={"retreiver": 2})
    config = DeploymentConfig.resolve(pipeline, batch_size={"llm.rewrite": 4, "retriever": 2})
    assert config.components["llm"].batch_sizes == {"generate": 1, "rewrite": 4}
    assert config.components["retriever"].batch_sizes == {"retrieve": 2, "lookup": 2}
    with pytest.raises(ValueError, match="backend must be one of"):
        DeploymentConfig.resolve(pipeline, backend="cluster")


def test_input_schema_checks_types_against_captured_values() -> None:
    schema = InputSchema({"query": "q", "topk": 3, "temperature": 0.5, "tags": ("a",), "flag": False})
    assert schema.check({"query": "x", "topk": 2, "temperature": 1, "tags": ["b"], "flag": True}) == {
        "query": "x", "topk": 2, "temperature": 1.0, "tags": ("b",), "flag": True,
    }
    with pytest.raises(patchkit.InputError, match="'topk' must be an integer"):
        schema.check({"query": "x", "topk": True, "temperature": 1, "tags": [], "flag": True})
    with pytest.raises(patchkit.InputError, match="missing input 'flag'"):
        schema.check({"query": "x", "topk": 2, "temperature": 1, "tags": []})
    assert InputSchema({"query": "q", "topk": 3}, optional=("topk",)).check({"query": "x"}) == {"query": "x"}


# -- the HTTP API -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def endpoint() -> Iterator[patchkit.Endpoint]:
    pipeline = captured(crag)
    with patchkit.deploy(pipeline, backend="inprocess", max_body_bytes=4096) as served:
        yield served


def post(url: str, path: str, body: bytes) -> tuple[int, dict[str, Any], dict[str, str]]:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, json.loads(data), dict(response.getheaders())


def get(url: str, path: str) -> tuple[int, bytes]:
    parts = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    connection.request("GET", path)
    response = connection.getresponse()
    data = response.read()
    connection.close()
    return response.status, data


def test_query_answers_like_the_pipeline(endpoint: patchkit.Endpoint) -> None:
    crag("How do I catch an exception?")
    pipeline = patchkit.last_pipeline()  # what the `with patchkit.capture():` block just run made: the deployed one
    assert sorted(pipeline.components) == ["grader", "llm", "retriever"]
    assert pipeline(query="What is a generator?") == crag_reference("What is a generator?")
    assert endpoint.query(query="What is a generator?") == crag_reference("What is a generator?")
    status, reply, _ = post(endpoint.url, "/v1/query", b'{"inputs": {"query": "What is a generator?"}}')
    assert status == 200 and reply["output"] == endpoint.query(query="What is a generator?")
    assert isinstance(reply["request_id"], str) and reply["latency_ms"] >= 0
    assert asyncio.run(endpoint.aquery(query="What is a generator?")) == reply["output"]


def crag_reference(query: str) -> str:
    docs = Retriever(topk=2).retrieve(query)
    if not Grader().grade(query, docs):
        docs = Retriever(topk=2).retrieve(Generator().rewrite(query))
    result: str = Generator().generate(query, docs)
    return result


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{not json", "not valid JSON"),
        (b'["query"]', "must be a JSON object"),
        (b'{"query": "x"}', "unknown field 'query'"),
        (b'{"inputs": {"qeury": "x"}}', "unknown pipeline input 'qeury'; did you mean 'query'"),
        (b'{"inputs": {}}', "missing input 'query'"),
        (b'{"inputs": {"query": 7}}', "input 'query' must be a string"),
        (b'{"inputs": {"query": "x"}, "slo_ms": -1}', "slo_ms must be a positive number"),
    ],
)
def test_bad_input_is_a_400_naming_what_is_wrong(endpoint: patchkit.Endpoint, body: bytes, message: str) -> None:
    status, reply, _ = post(endpoint.url, "/v1/query", body)
    assert status == 400
    assert reply["error"]["type"] == "InputError"
    assert message in reply["error"]["message"]


def test_a_body_over_the_limit_is_a_413(endpoint: patchkit.Endpoint) -> None:
    status, reply, _ = post(endpoint.url, "/v1/query", json.dumps({"inputs": {"query": "x" * 5000}}).encode())
    assert status == 413
    assert "4096 bytes" in reply["error"]["message"]
    assert endpoint.query(query="What is a generator?")


def test_query_raises_input_error_in_python(endpoint: patchkit.Endpoint) -> None:
    with pytest.raises(patchkit.InputError, match="unknown pipeline input 'q'"):
        endpoint.query(q="x")


def test_health_metrics_graph_plan_and_stats(endpoint: patchkit.Endpoint) -> None:
    endpoint.query(query="How do I catch an exception?")
    status, body = get(endpoint.url, "/healthz")
    assert status == 200 and json.loads(body)["status"] == "ok"
    status, body = get(endpoint.url, "/metrics")
    text = body.decode()
    assert status == 200
    assert metric(text, "patchkit_calls_total", component="retriever", method="retrieve") >= 1
    assert "# TYPE patchkit_request_duration_seconds histogram" in text
    assert metric(text, "patchkit_request_duration_seconds_count") == metric(text, "patchkit_requests_total", outcome="ok") >= 1
    assert metric(text, "patchkit_replicas", component="llm") == 1
    graph = json.loads(get(endpoint.url, "/v1/graph")[1])
    assert {n["component"] for n in graph["nodes"]} == {"retriever", "grader", "llm"}
    plan = json.loads(get(endpoint.url, "/v1/plan")[1])
    retriever = {"replicas": 1, "batch_sizes": {"retrieve": 32, "lookup": 1}, "resource": "cpu", "units": SHARES_PER_CORE}
    assert plan["components"]["retriever"] == retriever
    assert plan["plan"] is None  # no Plan applied: replicas and batch sizes come from the defaults
    assert plan["inputs"] == {"query": "a string"} and "secret" not in plan
    stats = endpoint.stats()
    assert stats["requests"]["ok"] >= 1
    assert stats["components"]["retriever"]["methods"]["retrieve"]["calls"] >= 1


def test_a_component_error_is_a_500_and_the_server_keeps_serving() -> None:
    pipeline = captured(checked, "fine")
    with patchkit.deploy(pipeline, backend="inprocess") as served:
        status, reply, _ = post(served.url, "/v1/query", b'{"inputs": {"query": "please fail"}}')
        assert status == 500
        assert reply["error"]["component"] == "flaky" and reply["error"]["method"] == "check"
        assert "ValueError: cannot check 'please fail'" in reply["error"]["message"]
        with pytest.raises(patchkit.ComponentError, match="flaky.check raised: ValueError"):
            served.query(query="fail again")
        assert served.query(query="fine") == "FINE"


def test_error_replies_carry_no_traceback_or_path_unless_debug() -> None:
    pipeline = captured(checked, "fine")
    with patchkit.deploy(pipeline, backend="inprocess") as served:
        status, reply, _ = post(served.url, "/v1/query", b'{"inputs": {"query": "please fail"}}')
        with pytest.raises(patchkit.ComponentError, match="ValueError: cannot check 'fail again'") as raised:
            served.query(query="fail again")
    assert status == 500 and set(reply["error"]) == {"type", "message", "component", "method"}
    here = str(Path(__file__).parent)  # where the failing component's source is
    assert "Traceback" not in json.dumps(reply) and here not in json.dumps(reply)
    assert raised.value.traceback_text == ""
    with patchkit.deploy(pipeline, backend="inprocess", debug=True) as served:
        status, reply, _ = post(served.url, "/v1/query", b'{"inputs": {"query": "please fail"}}')
        with pytest.raises(patchkit.ComponentError) as raised:
            served.query(query="fail again")
    assert status == 500 and "raise ValueError" in reply["error"]["traceback"]
    assert "raise ValueError" in raised.value.traceback_text


def test_more_requests_than_the_admission_bound_get_503_with_retry_after() -> None:
    pipeline = captured(tagged)

    async def body(frontend: Frontend) -> list[Any]:
        waiting = [asyncio.ensure_future(frontend.query({"query": "a"})), asyncio.ensure_future(frontend.query({"query": "b"}))]
        await asyncio.sleep(0)
        with pytest.raises(patchkit.Overloaded) as overloaded:
            await frontend.query({"query": "c"})
        assert (overloaded.value.queue_length, overloaded.value.limit) == (2, 2)
        return await asyncio.gather(*waiting)

    results = run_frontend(pipeline, body, max_inflight_requests=2, batch_size=2, batch_wait_ms=50)
    assert [r.output for r in results] == ["<a>", "<b>"]
    from patchkit.server.http import error_reply

    status, payload = error_reply(patchkit.Overloaded(5, 5))
    assert status == 503 and payload["error"]["limit"] == 5


def test_close_drains_requests_in_flight() -> None:
    pipeline = captured(tagged)

    async def body(frontend: Frontend) -> list[Any]:
        tasks = [asyncio.ensure_future(frontend.query({"query": str(i)})) for i in range(10)]
        await asyncio.sleep(0)
        closing = asyncio.ensure_future(frontend.close())
        await asyncio.sleep(0)
        with pytest.raises(patchkit.Overloaded, match="shutting down"):
            await frontend.query({"query": "late"})
        await closing
        return await asyncio.gather(*tasks)

    results = run_frontend(pipeline, body, batch_size=10, batch_wait_ms=100)
    assert [r.output for r in results] == [f"<{i}>" for i in range(10)]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_corpus_answers_the_same_deployed_inprocess(case: Case) -> None:
    pipeline, _ = capture_case(case)
    expected = [json.loads(json.dumps(pipeline(**inputs))) for inputs in case.inputs]
    with patchkit.deploy(pipeline, backend="inprocess", optional_inputs=tuple(pipeline.inputs)) as served:
        assert [served.query(**inputs) for inputs in case.inputs] == expected


class Outer(Component):
    """Holds another component and calls its @make method from inside its own."""

    def __init__(self, inner: Recorder) -> None:
        self.inner = inner

    @make
    def wrap(self, text: str) -> str:
        return "[" + self.inner.tag(text) + "]"


outer = Outer(Recorder())


def nested(query: str) -> patchkit.Pipeline:
    with patchkit.capture() as pipeline:
        return outer.wrap(query)
    return pipeline


def test_a_component_given_to_another_is_a_component_of_the_pipeline_too() -> None:
    pipeline = captured(nested, "q")
    assert [record.method for record in pipeline.recorded] == ["tag", "wrap"]  # the holder's call counts in visits
    assert set(pipeline.components) == {"outer", "outer_inner"}  # deployed once, shared (see test_shared.py)
    with patchkit.deploy(pipeline, backend="inprocess") as served:
        assert served.query(query="x") == "[<x>]"


class Tally(Component):
    """Counts its calls and reports them through `stats()`."""

    def __init__(self) -> None:
        self.seen = 0

    @make
    def count(self, text: str) -> str:
        self.seen += 1
        return text

    def stats(self) -> dict[str, Any]:
        return {"seen": self.seen, "cache": {"hit_rate": 0.5, "warm": True}, "device": "cpu"}


def test_a_components_own_stats_reach_metrics_per_replica() -> None:
    tally = Tally()
    text = "x"
    with patchkit.capture() as pipeline:
        out = tally.count(text)  # noqa: F841 - the pipeline's output
    with patchkit.deploy(pipeline, backend="inprocess") as served:
        served.query(text="a")
        served.query(text="b")
        reports = served.stats()["replica_reports"]
        with urllib.request.urlopen(served.url + "/metrics") as reply:  # noqa: S310 - a local test server
            metrics = reply.read().decode()
    [report] = reports.values()
    # inprocess replicas are the user's own object: the capture's eager run counted once too
    assert report["component_stats"] == {"seen": 3, "cache": {"hit_rate": 0.5, "warm": True}, "device": "cpu"}
    lines = [line for line in metrics.splitlines() if line.startswith("patchkit_component_stat{")]
    assert len(lines) == 3 and all('component="tally"' in line for line in lines)  # the string is left out
    [replica] = reports
    assert metric(metrics, "patchkit_component_stat", component="tally", replica=replica, stat="seen") == 3
    assert metric(metrics, "patchkit_component_stat", component="tally", replica=replica, stat="cache_warm") == 1
