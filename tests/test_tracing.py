"""OpenTelemetry spans: one per request, one per component call with its queue and batch, and the
worker's execution span a child of its call's span, also across processes."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from components import Generator  # noqa: E402
from opentelemetry import trace  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

import patchkit  # noqa: E402
from patchkit.serving.frontend import Frontend  # noqa: E402

llm = Generator()


def answer_pipeline() -> patchkit.Pipeline:
    question = "What is a generator?"
    with patchkit.capture(run=False) as pipeline:
        return llm.generate(question)  # type: ignore[no-any-return]
    return pipeline


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Spans of this process, into memory (the global provider can be set once per process)."""
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(TracerProvider())
    provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    memory = InMemorySpanExporter()
    processor = SimpleSpanProcessor(memory)
    provider.add_span_processor(processor)
    yield memory
    processor.shutdown()  # it stays registered, exporting nothing more


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def test_a_request_span_holds_its_calls_queue_batch_and_execution(exporter: InMemorySpanExporter) -> None:
    answer_pipeline()
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess") as endpoint:
        reply = httpx.post(endpoint.url + "/v1/query", json={"inputs": {"question": "q"}}, headers={"X-Request-ID": "otel-1"})
    assert reply.status_code == 200
    spans = exporter.get_finished_spans()
    [request] = by_name(spans, "patchkit.request")
    version = reply.headers["X-Pipeline-Version"]
    assert version.startswith("1-")  # the only pipeline's first version answered: its span names both
    assert request.attributes == {"patchkit.request_id": "otel-1", "patchkit.outcome": "ok", "patchkit.pipeline": "patchkit",
                                  "patchkit.pipeline_version": version}
    [call] = by_name(spans, "llm.generate")
    assert call.parent is not None and call.parent.span_id == request.context.span_id
    for child in ("queue", "batch", "llm.generate run"):
        [span] = by_name(spans, child)
        assert span.parent is not None and span.parent.span_id == call.context.span_id, child
        assert span.context.trace_id == request.context.trace_id
    queue, batch = by_name(spans, "queue")[0], by_name(spans, "batch")[0]
    assert call.start_time is not None and queue.start_time is not None and batch.end_time is not None
    assert queue.end_time == batch.start_time


def test_a_failed_request_span_says_so(exporter: InMemorySpanExporter) -> None:
    answer_pipeline()
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess", request_timeout_s=5) as endpoint:
        httpx.post(endpoint.url + "/v1/query", json={"inputs": {"question": ["not", "text"]}})  # refused at the edge: no span
        httpx.post(endpoint.url + "/v1/query", json={"inputs": {"question": "q"}})
    outcomes = [span.attributes["patchkit.outcome"] for span in by_name(exporter.get_finished_spans(), "patchkit.request")]
    assert outcomes == ["ok"]


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC receiver: the spans every process of a deployment exports."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service process pid, span)

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context: object) -> object:  # noqa: N802
        for resource_spans in request.resource_spans:
            pid = next((a.value.int_value for a in resource_spans.resource.attributes if a.key == "process.pid"), 0)
            for scope in resource_spans.scope_spans:
                self.spans += [(str(pid), span) for span in scope.spans]
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.mark.slow
def test_worker_execution_spans_are_children_across_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    for name, value in {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                        "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_BSP_SCHEDULE_DELAY": "100"}.items():
        monkeypatch.setenv(name, value)  # the front-end process and its workers inherit them
    try:
        answer_pipeline()
        with patchkit.deploy(patchkit.last_pipeline()) as endpoint:
            endpoint.query(question="q")
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and {"llm.generate", "llm.generate run"} - {s.name for _, s in collector.spans}:
                time.sleep(0.1)
    finally:
        server.stop(0)
    calls = [(pid, s) for pid, s in collector.spans if s.name == "llm.generate"]
    runs = [(pid, s) for pid, s in collector.spans if s.name == "llm.generate run"]
    assert len(calls) == 1 and len(runs) == 1, [s.name for _, s in collector.spans]
    (front_pid, call), (worker_pid, run) = calls[0], runs[0]
    assert run.parent_span_id == call.span_id and run.trace_id == call.trace_id
    assert front_pid != worker_pid != str(os.getpid())


def test_without_opentelemetry_every_helper_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import sys

    import patchkit.telemetry

    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # as if the `otel` extra were not installed
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    spec = importlib.util.spec_from_file_location("telemetry_without_otel", patchkit.telemetry.__file__)
    assert spec is not None and spec.loader is not None
    bare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bare)
    assert bare.otel_trace is None and bare.configure_from_env() is False
    request = bare.start_request("r")
    assert request is None and bare.start_call(request, "llm", "generate") == (None, None)
    with bare.execution("llm", "generate", [{"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}]):
        pass
    bare.end_request(request, "ok")


@pytest.mark.slow
def test_overlapped_calls_have_overlapping_spans_under_their_request(exporter: InMemorySpanExporter) -> None:
    from serving import run_frontend
    from test_parallel_calls import overlapped

    async def body(frontend: Frontend) -> None:
        await frontend.query({"tag": "t"})

    run_frontend(overlapped("x"), body, backend="local")
    spans = exporter.get_finished_spans()
    [request] = by_name(spans, "patchkit.request")
    [first], [second] = by_name(spans, "one.span"), by_name(spans, "two.span")
    for call in (first, second):
        assert call.parent is not None and call.parent.span_id == request.context.span_id
    assert first.end_time is not None and second.start_time is not None
    assert second.start_time < first.end_time  # both in flight at once
