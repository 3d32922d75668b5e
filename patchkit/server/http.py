"""The front-end's HTTP API (JSON only; nothing a client sends is ever unpickled).

    POST /v1/query   {"inputs": {...}, "slo_ms"?: n} -> {"output", "request_id", "latency_ms"}
    GET  /healthz    200 when every component has a live replica, else 503
    GET  /metrics    Prometheus text
    GET  /v1/graph   the captured graph
    GET  /v1/plan    the deployment's configuration: replicas and batch sizes per component, and the Plan applied
    GET  /v1/stats   per component: replicas, batches, throughput, queues (`Endpoint.stats()`)

Errors are `{"error": {"type", "message", ...}}`: 400 bad input, 413 body too large, 503 with
Retry-After when admission is closed, 504 past the request timeout, 500 with the component's error.
"""

from __future__ import annotations

import json
import traceback
from typing import Any

from aiohttp import web

from patchkit.errors import (
    ComponentError,
    DeadlineExceeded,
    InputError,
    Overloaded,
    PatchkitError,
    WorkerDiedError,
    error_to_json,
)
from patchkit.scheduler.online.frontend import Frontend
from patchkit.server.inputs import InputSchema, output_json
from patchkit.server.metrics import render_metrics

__all__ = ["build_app", "error_reply"]

_STATUS: list[tuple[type[BaseException], int]] = [(InputError, 400), (Overloaded, 503), (DeadlineExceeded, 504)]
_FRONTEND = web.AppKey("frontend", Frontend)
_SCHEMA = web.AppKey("schema", InputSchema)


def error_reply(error: BaseException) -> tuple[int, dict[str, Any]]:
    """The status and JSON error for what ended a request."""
    origin = getattr(error, "__patchkit_origin__", None)
    if origin is not None and not isinstance(error, WorkerDiedError):
        # A component's own exception, raised again inside the pipeline code and not caught there.
        component, method, text = origin
        error = ComponentError(component, method, f"{type(error).__name__}: {error}", text)
    elif not isinstance(error, PatchkitError):
        text = "".join(traceback.format_exception(error))
        error = ComponentError("pipeline", "run", f"{type(error).__name__}: {error}", text)
    status = next((code for kind, code in _STATUS if isinstance(error, kind)), 500)
    return status, {"error": error_to_json(error)}


def _json(status: int, payload: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json.dumps(payload).encode(), content_type="application/json", headers=headers)


def _error(error: BaseException) -> web.Response:
    status, payload = error_reply(error)
    return _json(status, payload, {"Retry-After": "1"} if status == 503 else None)


async def query(request: web.Request) -> web.Response:
    frontend = request.app[_FRONTEND]
    try:
        body = await request.read()
        inputs, slo_ms = request.app[_SCHEMA].parse(body)
        result = await frontend.query(inputs, slo_ms)
        output = output_json(result.output)
    except web.HTTPRequestEntityTooLarge:
        limit = frontend.config.max_body_bytes
        return _json(413, {"error": {"type": "InputError", "message": f"the body is over the limit of {limit} bytes"}})
    except Exception as exc:
        return _error(exc)
    body = b'{"output": %s, "request_id": %d, "latency_ms": %.3f}' % (output, result.request_id, result.latency_s * 1000)
    return web.Response(body=body, content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    frontend = request.app[_FRONTEND]
    healthy = frontend.healthy()
    return _json(200 if healthy else 503, {"status": "ok" if healthy else "degraded", "inflight": frontend.inflight})


async def metrics(request: web.Request) -> web.Response:
    frontend = request.app[_FRONTEND]
    text = render_metrics(frontend.snapshot(), await frontend.replica_stats())
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Prometheus-Format": "0.0.4"})


async def graph(request: web.Request) -> web.Response:
    return _json(200, request.app[_FRONTEND].pipeline.graph.to_json())


async def plan(request: web.Request) -> web.Response:
    frontend = request.app[_FRONTEND]
    return _json(200, {**frontend.config.describe(), "inputs": request.app[_SCHEMA].describe()})


async def stats(request: web.Request) -> web.Response:
    frontend = request.app[_FRONTEND]
    data = frontend.stats()
    if request.query.get("replicas") == "1":
        data["replica_reports"] = await frontend.replica_stats()
    return _json(200, data)


async def traces(request: web.Request) -> web.Response:
    """The last finished requests with an SLO, as the estimators saw them (timings and sizes only)."""
    return _json(200, {"traces": [trace.to_dict() for trace in request.app[_FRONTEND].policy.finished]})


def build_app(frontend: Frontend) -> web.Application:
    app = web.Application(client_max_size=frontend.config.max_body_bytes)
    app[_FRONTEND] = frontend
    app[_SCHEMA] = InputSchema(frontend.pipeline.inputs, frontend.config.optional_inputs)
    app.router.add_post("/v1/query", query)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/graph", graph)
    app.router.add_get("/v1/plan", plan)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/v1/traces", traces)
    return app
