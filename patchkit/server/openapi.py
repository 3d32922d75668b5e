"""The HTTP API as an OpenAPI 3.1 document, served by the front-end as `GET /openapi.json` and drawn in the reference.

The document is made from the routes the application serves (its router) and the bodies in code: each route's
request and reply bodies as `ROUTE_DOCS` names them (the shapes of `server/reports.py`, turned into JSON Schema by
pydantic), the error reply every route may give, and, served by a deployment, the inputs of its pipelines. A route
the router serves that `ROUTE_DOCS` does not describe is still listed, with its handler's docstring as its summary.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NotRequired

from pydantic import TypeAdapter
from typing_extensions import TypedDict

from patchkit.server.reports import PlanReport, QueryReply, Stats

__all__ = ["ROUTE_DOCS", "RouteDoc", "distribution_version", "document"]

OPENAPI_VERSION = "3.1.0"
SCHEMAS = "#/components/schemas/{model}"
JSON = "application/json"
EVENTS = "text/event-stream"
PROBES = frozenset({"/health", "/healthz", "/readyz", "/v1/pipelines/{name}/readyz"})  # without the token (http.py's _PROBES)
# How `InputSchema.describe` (server/inputs.py) words an input's JSON kind, as JSON Schema's types.
INPUT_KINDS = {"a string": "string", "true or false": "boolean", "an integer": "integer", "a number": "number",
               "a list": "array", "an object": "object"}


class QueryRequest(TypedDict):
    """`POST /v1/query`'s body."""

    inputs: dict[str, Any]
    """The pipeline's inputs by name; every one is required but those the deployment names in optional_inputs."""
    slo_ms: NotRequired[float]
    """This request's latency target, in milliseconds (default: the deployment's slo_ms)."""
    stream: NotRequired[bool]
    """True: a text/event-stream of `{"delta": ...}` events, then the final `{"output", "request_id", ...}`."""
    options: NotRequired[dict[str, Any]]
    """Sampling options (max_tokens, stop, temperature, top_p, seed, ...) for the call whose result is the output."""
    field: NotRequired[str]
    """Of a dict output, the field whose call the options (and the stream) are for."""


class ErrorBody(TypedDict):
    type: str
    """The error's type: an error of patchkit.errors (InputError, ComponentError, ...) or the HTTP refusal's."""
    message: str


class ErrorReply(TypedDict):
    """Every error: its type and message, never a traceback unless the deployment has debug=True."""

    error: ErrorBody
    request_id: NotRequired[str]


class Health(TypedDict):
    status: str
    workers: str
    """"ok", or "degraded" while a component has no replica passing its health checks."""
    inflight: int
    inflight_bytes: int


class OwnReadiness(TypedDict):
    """A pipeline's readiness (`GET /v1/pipelines/{name}/readyz`), or a component's that is not ready."""

    status: str
    """A pipeline's: "ready", "starting", "unready" (a component it calls has no replica serving), "failed" (a
    component it calls could not start, or its replicas could not be started again: until an update) or
    "draining". A component's: "failed", "unready", or "degraded" (a replica serves, another does not)."""
    reasons: list[str]
    """Why it is not ready, a line per replica or component (never an error's text)."""


class Readiness(TypedDict):
    """`GET /readyz`: the deployment's readiness, each pipeline's, and each component's that is not ready."""

    status: str
    """"ready"; "degraded" (200: some pipelines are failed, every other one is ready); "starting", "unready" (a
    pipeline not failed is not ready), "failed" (every pipeline is) or "draining"."""
    reasons: list[str]
    """Why not every pipeline is ready, a line per replica or component."""
    pipelines: dict[str, OwnReadiness]
    """By pipeline name."""
    components: dict[str, OwnReadiness]
    """By component name, those not wholly ready only: "failed", "unready" or "degraded"."""


@dataclass(frozen=True)
class RouteDoc:
    """One route: what it does, its body, and its replies by status (a shape, a media type, or None)."""

    summary: str
    request: Any = None
    replies: Mapping[int, tuple[str, Any]] = field(default_factory=dict)
    stream: bool = False  # its 200 may be a text/event-stream
    text: str | None = None  # its 200 is this media type, not JSON


_OBJECT = dict[str, Any]
ROUTE_DOCS: dict[tuple[str, str], RouteDoc] = {
    ("POST", "/v1/query"): RouteDoc(
        "Run the only pipeline served on these inputs", QueryRequest,
        {200: ("its output; with stream: true, server-sent events", QueryReply),
         400: ("bad input, or several pipelines served", ErrorReply), 413: ("body too large", ErrorReply),
         500: ("a component raised", ErrorReply), 503: ("admission closed (Retry-After), or a component failed",
                                                        ErrorReply),
         504: ("past the request's deadline", ErrorReply)}, stream=True),
    ("POST", "/v1/pipelines/{name}/query"): RouteDoc(
        "Run pipeline `name` on these inputs", QueryRequest,
        {200: ("its output; with stream: true, server-sent events", QueryReply),
         400: ("bad input", ErrorReply), 404: ("no pipeline of that name", ErrorReply),
         413: ("body too large", ErrorReply), 500: ("a component raised", ErrorReply),
         503: ("admission closed (Retry-After), or a component failed", ErrorReply),
         504: ("past the request's deadline", ErrorReply)}, stream=True),
    ("GET", "/v1/pipelines"): RouteDoc("Each pipeline served: name, version, digest, inputs, output, state",
                                       replies={200: ("the pipelines", _OBJECT)}),
    ("GET", "/v1/graph"): RouteDoc("The only pipeline's captured graph (Graph.to_json)",
                                   replies={200: ("nodes, edges, loops, overlap groups", _OBJECT)}),
    ("GET", "/v1/pipelines/{name}/graph"): RouteDoc(
        "Pipeline `name`'s captured graph", replies={200: ("nodes, edges, loops, overlap groups", _OBJECT),
                                                     404: ("no pipeline of that name", ErrorReply)}),
    ("GET", "/v1/plan"): RouteDoc("The deployment's options, components and plan (Endpoint.plan())",
                                  replies={200: ("the plan", PlanReport)}),
    ("GET", "/v1/stats"): RouteDoc("Per component: replicas, batches, throughput, queues (Endpoint.stats())",
                                   replies={200: ("the counters", Stats)}),
    ("GET", "/v1/traces"): RouteDoc("The last finished requests with an SLO, timings and sizes only",
                                    replies={200: ("the traces", _OBJECT)}),
    ("GET", "/health"): RouteDoc("As vLLM's: 200, no body, while every component has a healthy replica",
                                 replies={200: ("healthy", None), 503: ("unhealthy, and why", _OBJECT)}, text="text/plain"),
    ("GET", "/healthz"): RouteDoc("Liveness: 200 whenever the process answers", replies={200: ("alive", Health)}),
    ("GET", "/readyz"): RouteDoc(
        "Readiness: 200 while every pipeline that is not failed has its workers up",
        replies={200: ("ready, or degraded (some pipelines failed, the others ready)", Readiness),
                 503: ("starting, unready (a pipeline not failed is not ready), failed (every pipeline is) or draining, "
                       "and why", Readiness)}),
    ("GET", "/v1/pipelines/{name}/readyz"): RouteDoc(
        "Pipeline `name`'s readiness: 200 while every component it calls has its workers up",
        replies={200: ("ready", OwnReadiness),
                 503: ("starting, unready (a replica being replaced or failing its health checks), failed (a component "
                       "cannot start) or draining, and why", OwnReadiness),
                 404: ("no pipeline of that name", ErrorReply)}),
    ("GET", "/metrics"): RouteDoc("Prometheus metrics", replies={200: ("the text exposition format", None)},
                                  text="text/plain"),
    ("GET", "/v1/models"): RouteDoc("The OpenAI models API: a model per pipeline served",
                                    replies={200: ("the models", _OBJECT)}),
    ("POST", "/v1/chat/completions"): RouteDoc(
        "The OpenAI chat completions API over a pipeline (`model`: its name)", _OBJECT,
        {200: ("a chat completion; with stream: true, server-sent chunks", _OBJECT),
         400: ("bad input, or a field the pipeline neither takes nor honours", _OBJECT),
         404: ("no model of that name (code model_not_found)", _OBJECT)}, stream=True),
    ("GET", "/openapi.json"): RouteDoc("This document", replies={200: ("the OpenAPI document", _OBJECT)}),
}
_STARTING = (503, ("the workers are still starting (Retry-After)", ErrorReply))
_UNAUTHORIZED = (401, ("the deployment's bearer token is missing or wrong", ErrorReply))


def document(routes: Iterable[tuple[str, str, Any]], *, inputs: Mapping[str, Mapping[str, str]] | None = None,
             auth: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `routes`.

    Called by the `GET /openapi.json` route with its application's router, and by the site's build with every
    route of `ROUTE_DOCS`.

    Args:
        routes: (method, path, handler) of each route served; a handler may be None.
        inputs: by pipeline name, its inputs and their JSON kinds (`InputSchema.describe`); the only pipeline's
            go into `POST /v1/query`'s body.
        auth: the deployment asks for a bearer token (on every route but the probes).

    Returns:
        The document, JSON-able.
    """
    paths: dict[str, dict[str, Any]] = {}
    for method, path, handler in routes:
        if method in ("HEAD", "OPTIONS", "*"):
            continue
        doc = ROUTE_DOCS.get((method, path)) or RouteDoc(_summary(handler), replies={200: ("the reply", None)})
        paths.setdefault(path, {})[method.lower()] = _operation(path, doc, inputs, auth)
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "patchkit", "version": distribution_version(),
                 "description": "A deployment's HTTP API: its pipelines, their health, plan, stats and metrics."},
        "paths": dict(sorted(paths.items())),
        "components": {"schemas": _schemas(), **({"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
                                                  if auth else {})},
    }


def _operation(path: str, doc: RouteDoc, inputs: Mapping[str, Mapping[str, str]] | None, auth: bool) -> dict[str, Any]:
    replies = dict(doc.replies)
    if path not in PROBES:
        replies.setdefault(*_STARTING)
        if auth:
            replies.setdefault(*_UNAUTHORIZED)
    operation: dict[str, Any] = {"summary": doc.summary, "responses": {
        str(status): _reply(status, text, shape, doc) for status, (text, shape) in sorted(replies.items())}}
    parameters = [{"name": part[1:-1], "in": "path", "required": True, "schema": {"type": "string"}}
                  for part in path.split("/") if part.startswith("{") and part.endswith("}")]
    if parameters:
        operation["parameters"] = parameters
    if doc.request is not None:
        schema = _schema_of(doc.request)
        if doc.request is QueryRequest and inputs and len(inputs) == 1 and path == "/v1/query":
            schema = _query_with_inputs(next(iter(inputs.values())))
        operation["requestBody"] = {"required": True, "content": {JSON: {"schema": schema}}}
    if auth and path not in PROBES:
        operation["security"] = [{"bearer": []}]
    return operation


def _reply(status: int, text: str, shape: Any, doc: RouteDoc) -> dict[str, Any]:
    if doc.text is not None and status == 200:
        return {"description": text, "content": {doc.text: {"schema": {"type": "string"}}}}
    reply: dict[str, Any] = {"description": text}
    if shape is not None:
        reply["content"] = {JSON: {"schema": _schema_of(shape)}}
        if doc.stream and status == 200:
            reply["content"][EVENTS] = {"schema": {"type": "string"}}
    return reply


def _query_with_inputs(kinds: Mapping[str, str]) -> dict[str, Any]:
    """`POST /v1/query`'s body with the pipeline's own inputs (their JSON kinds, where the schema knows them)."""
    properties = {name: ({"type": INPUT_KINDS[kind]} if kind in INPUT_KINDS else {}) for name, kind in kinds.items()}
    return {"allOf": [{"$ref": SCHEMAS.format(model="QueryRequest")},
                      {"type": "object", "properties": {"inputs": {"type": "object", "properties": properties}}}]}


def _schema_of(shape: Any) -> dict[str, Any]:
    if isinstance(shape, type) and shape.__name__ in _schemas():
        return {"$ref": SCHEMAS.format(model=shape.__name__)}
    return {"type": "object"}


@functools.cache
def _schemas() -> dict[str, Any]:
    """Every TypedDict the routes name, as JSON Schema (pydantic), their nested shapes included."""
    found: dict[str, Any] = {}
    for shape in (QueryRequest, QueryReply, ErrorReply, Health, Readiness, OwnReadiness, Stats, PlanReport):
        schema = TypeAdapter(shape).json_schema(ref_template=SCHEMAS)
        found.update(schema.pop("$defs", {}))
        found[shape.__name__] = schema
    return found


def _summary(handler: Any) -> str:
    text = inspect.getdoc(handler) or ""
    return text.splitlines()[0] if text else ""


def distribution_version() -> str:
    """The installed distribution's version (pyproject.toml's `name`): the document's `info.version`, the MCP server's."""
    try:
        return importlib.metadata.version("patchkit-rag")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
