"""OpenTelemetry tracing, optional (`pip install -e '.[otel]'` in the checkout); with it absent every helper here is a no-op.

The spans of one request, with the front-end's on one side and the worker's on the other:

    patchkit.request                 (front-end) patchkit.request_id, patchkit.outcome
      <component>.<method>           (front-end) one per component call
        queue                        from the call's submission until its batch left
        batch                        from the batch leaving until its outcome came back
        <component>.<method> run     (worker) the batch's execution, a child through the carried context

A call's context travels to its worker in the batch message (a W3C `traceparent` per call, since one
batch holds calls of several requests); only calls of recording spans carry one. The front-end and
worker processes export over OTLP when the standard variables ask for it (`configure_from_env`); a
deployment in the user's own process (backend="inprocess") uses whatever tracer provider the user set.
A leaf: imports nothing of patchkit.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import trace as otel_trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the `otel` extra is not installed: nothing is traced
    otel_trace = None  # type: ignore[assignment]

__all__ = ["Carrier", "configure_from_env", "end_call", "end_request", "execution", "start_call", "start_request"]

logger = logging.getLogger(__name__)

Carrier = dict[str, str]  # a call's trace context, as W3C headers (`traceparent`, `tracestate`)
Span = Any  # an opentelemetry Span, or None where nothing is traced
_configured = False


def _tracer() -> Any:
    return otel_trace.get_tracer("patchkit")


def configure_from_env() -> bool:
    """Export spans over OTLP when the standard variables say so: OTEL_TRACES_EXPORTER=otlp (or console),
    or an OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT with no exporter named. The protocol is
    OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL (http/protobuf by default, or grpc); endpoint, headers and
    batching (OTEL_BSP_*) are read by the SDK itself. Returns whether spans are exported.

    Called once by the front-end process and by each worker at start; nothing happens without the
    variables, without opentelemetry-sdk (a warning), or a second time."""
    global _configured
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if _configured or otel_trace is None or exporter == "none" or not (exporter or endpoint):
        return False
    if exporter not in ("", "otlp", "console"):
        logger.warning("OTEL_TRACES_EXPORTER=%s is not supported here (otlp, console, none): no spans are exported", exporter)
        return False
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    except ImportError:
        logger.warning("the OTEL_* variables ask for traces, but opentelemetry-sdk is not installed: "
                       "pip install -e '.[otel]' in patchkit's checkout")
        return False
    span_exporter = ConsoleSpanExporter() if exporter == "console" else _otlp_exporter()
    if span_exporter is None:
        return False
    attributes: dict[str, str | int] = {"process.pid": os.getpid()}  # tells the front-end and each worker apart
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = "patchkit"
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    otel_trace.set_tracer_provider(provider)
    atexit.register(provider.shutdown)  # flushes what is batched when the process exits normally
    _configured = True
    return True


def _otlp_exporter() -> Any:
    """OTLP over the protocol the variables name; unnamed: http/protobuf, else grpc, whichever is installed."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    wanted = [protocol.strip().lower()] if protocol else ["http/protobuf", "grpc"]
    for name in wanted:
        try:
            if name == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # type: ignore[no-redef]
        except ImportError:
            continue
        return OTLPSpanExporter()
    logger.warning("no OTLP exporter for %s is installed (opentelemetry-exporter-otlp-proto-grpc or -http): no spans "
                   "are exported", " or ".join(wanted))
    return None


# -- the front-end's side ----------------------------------------------------------------------------------
def start_request(request_id: str, pipeline: str = "", version: str = "") -> Span:
    """The span of one request, started when the front-end takes it, naming its pipeline and that pipeline's
    version; None without opentelemetry."""
    if otel_trace is None:
        return None
    attributes = {"patchkit.request_id": request_id, "patchkit.pipeline": pipeline, "patchkit.pipeline_version": version}
    return _tracer().start_span("patchkit.request", attributes=attributes)


def end_request(span: Span, outcome: str) -> None:
    """End a request's span with its outcome (ok, error, timeout, overloaded, worker_died, ...)."""
    if span is None:
        return
    span.set_attribute("patchkit.outcome", outcome)
    if outcome != "ok":
        span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, outcome))
    span.end()


def start_call(request: Span, component: str, method: str) -> tuple[Span, Carrier | None]:
    """A component call's span, a child of its request's, and the context its worker gets (None when
    the span does not record: nothing is sent)."""
    if request is None or not request.is_recording():
        return None, None
    parent = otel_trace.set_span_in_context(request)
    span = _tracer().start_span(f"{component}.{method}", context=parent,
                                attributes={"patchkit.component": component, "patchkit.method": method})
    carrier: Carrier = {}
    TraceContextTextMapPropagator().inject(carrier, context=otel_trace.set_span_in_context(span))
    return span, carrier


def end_call(span: Span, submitted_ns: int, dispatched_ns: int | None, error: str | None) -> None:
    """End a call's span, with its `queue` and `batch` stretches as child spans (times from `time.time_ns()`)."""
    if span is None:
        return
    now = time.time_ns()
    parent = otel_trace.set_span_in_context(span)
    if dispatched_ns is not None:
        _tracer().start_span("queue", context=parent, start_time=submitted_ns).end(end_time=dispatched_ns)
        _tracer().start_span("batch", context=parent, start_time=dispatched_ns).end(end_time=now)
    if error is not None:
        span.set_status(otel_trace.Status(otel_trace.StatusCode.ERROR, error))
    span.end(end_time=now)


# -- the worker's side --------------------------------------------------------------------------------------
@contextmanager
def execution(component: str, method: str, carriers: Sequence[Carrier | None] | None) -> Iterator[None]:
    """Around a batch's execution on a worker: one span per call that carried a context, each a child
    of that call's span at the front-end. Called by the worker (and the inprocess replica) per batch."""
    if otel_trace is None or not carriers or not any(carriers):
        yield
        return
    propagator, size = TraceContextTextMapPropagator(), len(carriers)
    spans = [
        _tracer().start_span(f"{component}.{method} run", context=propagator.extract(carrier),
                             attributes={"patchkit.component": component, "patchkit.batch_size": size})
        for carrier in carriers if carrier
    ]
    try:
        yield
    finally:
        for span in spans:
            span.end()
