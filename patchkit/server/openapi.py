"""The HTTP API as an OpenAPI 3.1 document, served by the front-end as `GET /openapi.json` and drawn in the reference.

The document is made from the routes the application serves (its router) and the bodies in code: each route's
request and reply bodies as `ROUTE_DOCS` names them (the shapes of `server/reports.py`, turned into JSON Schema by
pydantic), the error reply every route may give, and, served by a deployment, the inputs of its pipelines. A route
the router serves that `ROUTE_DOCS` does not describe is still listed, with its handler's docstring as its summary.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import urllib.parse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field, TypeAdapter
from typing_extensions import TypedDict

from patchkit.core.options import options_schema
from patchkit.server.events import STREAM_DESCRIPTION, STREAM_EVENTS, StreamDelta, StreamEnd, StreamError, StreamStep
from patchkit.server.inputs import MAX_SLO_MS
from patchkit.server.reports import ErrorReply, PlanReport, QueryReply, Stats

__all__ = ["ROUTE_DOCS", "STREAM_EVENTS", "PipelineDoc", "RouteDoc", "distribution_version", "document", "query_body",
           "stream_schema"]

OPENAPI_VERSION = "3.1.0"
SCHEMAS = "#/components/schemas/{model}"
JSON = "application/json"
EVENTS = "text/event-stream"
PROBES = frozenset({"/health", "/healthz", "/readyz", "/v1/pipelines/{name}/readyz"})  # without the token (http.py's _PROBES)


class QueryRequest(TypedDict):
    """`POST /v1/query`'s body, of any pipeline (each served pipeline's own path says its inputs)."""

    inputs: dict[str, Any]
    """The pipeline's inputs by name; every one is required but those the deployment names in optional_inputs."""
    slo_ms: NotRequired[float | None]
    """This request's latency target, in milliseconds (default: the deployment's slo_ms)."""
    stream: NotRequired[bool]
    """True: a text/event-stream (the events are named in the reply's description)."""
    steps: NotRequired[bool]
    """With stream: an `event: step` as each component call starts and ends (or `?steps=true`); refused where the
    deployment's steps option is "off"."""
    options: NotRequired[dict[str, Any] | None]
    """Sampling options (max_tokens, stop, temperature, top_p, seed, ...) for the call whose result is the output."""
    field: NotRequired[str | None]
    """Of a dict output, the field whose call the options (and the stream) are for."""


class ChatMessage(TypedDict):
    role: str
    content: NotRequired[str | list[Any] | None]
    """Its text, or a list of content parts (the text parts are read)."""


class ChatRequest(TypedDict):
    """`POST /v1/chat/completions`'s body, of any model (a deployment's document gives its models' own)."""

    model: NotRequired[str | None]
    """The pipeline's name (GET /v1/models); required where several are served."""
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    """The conversation; the last user message fills the pipeline's text input (chat_input)."""
    stream: NotRequired[bool | None]
    n: NotRequired[Literal[1] | None]


class OpenAIErrorBody(TypedDict):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(TypedDict):
    """The chat API's errors, in OpenAI's form."""

    error: OpenAIErrorBody


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
    """One route: what it does, its body, and its replies by status (a shape, a media type, or None).

    `text`: the media type (or types) of its 200 where it is not JSON; `only`: it answers the only pipeline
    served, so it is left out where several are (it would answer 400 naming them); `public`: served without the
    token; `params`: the JSON Schema of a path parameter, by name, where it is not any string.
    """

    summary: str
    request: Any = None
    replies: Mapping[int, tuple[str, Any]] = field(default_factory=dict)
    stream: bool = False  # its 200 may be a text/event-stream
    text: str | tuple[str, ...] | None = None  # its 200 is this media type, not JSON
    only: bool = False
    public: bool = False
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True)
class PipelineDoc:
    """What the document says of one served pipeline.

    Its `inputs` object (`InputSchema.json_schema`), its output's fields, the call options the call that answers
    honours, whether step events are offered, and the chat request body its model takes (None: no chat request
    can be answered by it).
    """

    inputs: Mapping[str, Any]
    fields: tuple[str, ...] = ()
    honoured: frozenset[str] | None = frozenset()  # None: any option (of a pipeline the document does not know)
    steps: bool = True
    chat: Mapping[str, Any] | None = None


_OBJECT = dict[str, Any]
_QUERY_REPLIES: dict[int, tuple[str, Any]] = {
    200: ("its output; with stream: true, server-sent events", QueryReply),
    400: ("bad input (the body names what to fix)", ErrorReply), 500: ("a component raised", ErrorReply),
    503: ("admission closed (Retry-After), or a component failed", ErrorReply),
    504: ("past the request's deadline", ErrorReply)}
DASHBOARD_FILES = ("app.js", "style.css", "index.html")  # the dashboard's files under /dashboard/
ROUTE_DOCS: dict[tuple[str, str], RouteDoc] = {
    ("POST", "/v1/query"): RouteDoc("Run the only pipeline served on these inputs", QueryRequest, _QUERY_REPLIES,
                                    stream=True, only=True),
    ("POST", "/v1/pipelines/{name}/query"): RouteDoc(
        "Run pipeline `name` on these inputs (each pipeline served also has its own path, with its inputs)",
        QueryRequest, {**_QUERY_REPLIES, 404: ("no pipeline of that name", ErrorReply)}, stream=True),
    ("GET", "/v1/pipelines"): RouteDoc("Each pipeline served: name, version, digest, inputs, output, state",
                                       replies={200: ("the pipelines", _OBJECT)}),
    ("GET", "/v1/graph"): RouteDoc("The only pipeline's captured graph (Graph.to_json)",
                                   replies={200: ("nodes, edges, loops, overlap groups", _OBJECT)}, only=True),
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
                                 replies={200: ("healthy", None), 503: ("unhealthy, and why", _OBJECT)}),
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
        "The OpenAI chat completions API over a pipeline (`model`: its name)", ChatRequest,
        {200: ("a chat completion; with stream: true, server-sent chunks then `data: [DONE]`", _OBJECT),
         400: ("bad input, or a field the pipeline neither takes nor honours", OpenAIError),
         404: ("no model of that name (code model_not_found)", OpenAIError),
         500: ("a component raised", OpenAIError), 503: ("admission closed, or a component failed", OpenAIError),
         504: ("past the request's deadline", OpenAIError)}, stream=True),
    ("GET", "/openapi.json"): RouteDoc("This document", replies={200: ("the OpenAPI document", _OBJECT)}),
    ("GET", "/"): RouteDoc("A short page linking to the dashboard and the API", replies={200: ("the page", None)},
                           text="text/html", public=True),
    ("GET", "/dashboard"): RouteDoc("The dashboard's page", replies={200: ("the page", None)}, text="text/html",
                                    public=True),
    ("GET", "/dashboard/{file}"): RouteDoc(
        "A file of the dashboard (its script, its style)",
        replies={200: ("the file", None), 404: ("no file of that name", ErrorReply)},
        text=("text/javascript", "text/css", "text/html"), public=True, params={"file": {"enum": list(DASHBOARD_FILES)}}),
    ("GET", "/v1/activity"): RouteDoc("The last requests' calls (timings only) and the autoscaler's decisions",
                                      replies={200: ("requests and decisions", _OBJECT)}),
    ("GET", "/v1/graph.svg"): RouteDoc("The only pipeline's graph, drawn", replies={200: ("the picture", None)},
                                       text="image/svg+xml", only=True),
    ("GET", "/v1/pipelines/{name}/graph.svg"): RouteDoc(
        "Pipeline `name`'s graph, drawn", replies={200: ("the picture", None), 404: ("no pipeline of that name",
                                                                                    ErrorReply)},
        text="image/svg+xml"),
}
_STARTING = (503, ("the workers are still starting (Retry-After)", ErrorReply))
_UNAUTHORIZED = (401, ("the deployment's bearer token is missing or wrong", ErrorReply))
_BAD_REQUEST_ID = (400, ("a malformed X-Request-ID header (1 to 200 printable ASCII characters)", ErrorReply))
# What the edge answers for a request with a body (http.py's read_body), whatever the route.
_BODY_REPLIES: dict[int, tuple[str, Any]] = {
    400: ("a body that is not strict JSON, or nests past 64 levels", ErrorReply),
    408: ("the body did not arrive within read_timeout_s", ErrorReply),
    413: ("the body is over max_body_bytes (decoded)", ErrorReply),
    415: ("a Content-Encoding other than gzip, deflate or identity", ErrorReply),
    503: ("request bodies in flight are over max_inflight_bytes (Retry-After)", ErrorReply)}
# The client's own request id (`server/request_ids.py`): 1 to 200 printable ASCII characters (its ends not blank,
# which HTTP would strip); any other is a 400. Every reply carries the id in the same header.
REQUEST_ID_PARAMETER = {"name": "X-Request-ID", "in": "header", "required": False,
                        "description": "the request's id, kept in its reply, its logs and its traces (default: a fresh one)",
                        "schema": {"type": "string", "pattern": "^[!-~]([ -~]{0,198}[!-~])?$"}}
REPLY_HEADERS = {"X-Request-ID": {"required": True, "description": "the request's id: the client's, else a fresh one",
                                  "schema": {"type": "string"}}}
QUERY_PATH = "/v1/pipelines/{name}/query"
CHAT_PATH = "/v1/chat/completions"


def document(routes: Iterable[tuple[str, str, Any]], *, pipelines: Mapping[str, PipelineDoc] | None = None,
             auth: bool = False) -> dict[str, Any]:
    """The OpenAPI 3.1 document of `routes`.

    Called by the `GET /openapi.json` route with its application's router, and by the site's build with every
    route of `ROUTE_DOCS`.

    Args:
        routes: (method, path, handler) of each route served; a handler may be None.
        pipelines: by name, each pipeline served (`PipelineDoc`): each gets its own query path
            (`/v1/pipelines/NAME/query`, its body typed by its inputs), and the only one's go into
            `POST /v1/query`'s body; with several, the routes of the only pipeline are left out.
        auth: the deployment asks for a bearer token (on every route but the probes and the dashboard's files).

    Returns:
        The document, JSON-able.
    """
    served = dict(pipelines or {})
    paths: dict[str, dict[str, Any]] = {}
    for method, path, handler in routes:
        if method in ("HEAD", "OPTIONS", "*") or path in OTHER_PROTOCOLS:
            continue
        doc = ROUTE_DOCS.get((method, path)) or RouteDoc(_summary(handler), replies={200: ("the reply", None)})
        if (method, path) == ("POST", CHAT_PATH) and served:
            doc = dataclasses.replace(doc, request=_chat_body(served))
            if doc.request is None:
                continue  # no pipeline served can answer a chat request: it would answer each 400
        if doc.only and len(served) > 1:
            continue  # it would answer each request 400, naming the pipelines
        only = next(iter(served.values())) if len(served) == 1 and doc.only else None
        paths.setdefault(path, {})[method.lower()] = _operation(path, doc, only, auth)
        if (method, path) == ("POST", QUERY_PATH):
            paths.update(_pipeline_paths(served, auth))
    return {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "patchkit", "version": distribution_version(), "description": DESCRIPTION},
        "paths": dict(sorted((path, methods) for path, methods in paths.items() if methods)),
        "components": {"schemas": _schemas(), **({"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
                                                  if auth else {})},
    }


OTHER_PROTOCOLS = frozenset({"/mcp"})  # routes another protocol's specification describes: not listed
DESCRIPTION = ("A deployment's HTTP API: its pipelines, their health, plan, stats and metrics. Every reply carries "
               "the request's id in X-Request-ID. With several pipelines served, the routes of the only pipeline "
               "(/v1/query, /v1/graph, /v1/graph.svg) answer 400 naming them and are not listed; each pipeline has "
               "its own query path, /v1/pipelines/NAME/query, whose body names its inputs. /mcp serves the pipelines "
               "as tools of the Model Context Protocol (Streamable HTTP, JSON-RPC messages that its own "
               "specification describes) and is not listed here.")


def _pipeline_paths(served: Mapping[str, PipelineDoc], auth: bool) -> dict[str, dict[str, Any]]:
    """A query path of each pipeline served, its body typed by the pipeline's inputs."""
    paths: dict[str, dict[str, Any]] = {}
    for name, pipeline in served.items():
        own = QUERY_PATH.replace("{name}", urllib.parse.quote(name, safe=""))
        mine = RouteDoc(f"Run pipeline {name!r} on these inputs", QueryRequest, _QUERY_REPLIES, stream=True)
        paths[own] = {"post": _operation(own, mine, pipeline, auth)}
    return paths


def _operation(path: str, doc: RouteDoc, pipeline: PipelineDoc | None, auth: bool) -> dict[str, Any]:
    replies = dict(doc.replies)
    edge = [*(_BODY_REPLIES.items() if doc.request is not None else ()), _BAD_REQUEST_ID]
    guarded = path not in PROBES and not doc.public
    if guarded:
        edge.append(_STARTING)
    if auth and (guarded or doc.params):  # a dashboard file's path that names none asks for the token
        edge.append(_UNAUTHORIZED)
    for status, (text, shape) in edge:  # the edge's own replies, beside the route's of the same status
        known, shapes = replies.get(status, (text, ()))
        shapes = shapes if isinstance(shapes, tuple) else (shapes,)
        replies[status] = (known, shapes if shape in shapes else (*shapes, shape))
    operation: dict[str, Any] = {"summary": doc.summary, "responses": {
        str(status): _reply(status, text, shape, doc) for status, (text, shape) in sorted(replies.items())}}
    parameters = [{"name": part[1:-1], "in": "path", "required": True,
                   "schema": dict(doc.params.get(part[1:-1], {"type": "string"}))}
                  for part in path.split("/") if part.startswith("{") and part.endswith("}")]
    operation["parameters"] = [*parameters, REQUEST_ID_PARAMETER]
    if doc.request is not None:
        if isinstance(doc.request, Mapping):  # a schema made for the deployment (the chat body)
            schema = dict(doc.request)
        elif doc.request is QueryRequest and pipeline is not None:
            schema = query_body(pipeline)
        else:
            schema = _schema_of(doc.request)
        operation["requestBody"] = {"required": True, "content": {JSON: {"schema": schema}}}
    if auth and guarded:
        operation["security"] = [{"bearer": []}]
    return operation


def _reply(status: int, text: str, shape: Any, doc: RouteDoc) -> dict[str, Any]:
    if doc.text is not None and status == 200:
        kinds = (doc.text,) if isinstance(doc.text, str) else doc.text
        return {"description": text, "headers": REPLY_HEADERS,
                "content": {kind: {"schema": {"type": "string"}} for kind in kinds}}
    reply: dict[str, Any] = {"description": text, "headers": REPLY_HEADERS}
    if shape is not None:
        reply["content"] = {JSON: {"schema": _schema_of(shape)}}
        if doc.stream and status == 200:
            reply["description"] = f"{text}. {STREAM_DESCRIPTION}" if doc.request is QueryRequest else text
            reply["content"][EVENTS] = {"schema": stream_schema() if doc.request is QueryRequest else {}}
    return reply


def stream_schema() -> dict[str, Any]:
    """A query stream's events, each as an SSE reader sees it: `{"event", "data"}`, unnamed ones as "message".

    Each event's data is JSON of the schema its name says (`STREAM_EVENTS`).
    """

    def event(name: str, *shapes: type) -> dict[str, Any]:
        refs = [{"$ref": SCHEMAS.format(model=shape.__name__)} for shape in shapes]
        data = {"type": "string", "contentMediaType": JSON, "contentSchema": refs[0] if len(refs) == 1 else {"anyOf": refs}}
        return {"type": "object", "required": ["data"] if name == "message" else ["event", "data"],
                "properties": {"event": {"const": name}, "data": data}}

    return {"description": "each event of the stream, by its name", "oneOf": [
        event("message", StreamDelta, QueryReply), event("step", StreamStep), event("error", StreamError),
        event("end", StreamEnd)]}


def query_body(pipeline: PipelineDoc) -> dict[str, Any]:
    """A query route's body for `pipeline`: its own inputs, and only what the server accepts of the rest.

    `steps`, where the deployment offers no step events, can only be false; `field`, where the output is a dict
    with known fields, names one of them (else it is ignored); `options` holds the options the answering call
    honours (`core.options.options_schema`).
    """
    field_schema: dict[str, Any] = ({"enum": [*pipeline.fields, None]} if pipeline.fields else
                                    {"type": ["string", "null"], "description": "ignored: the output has no fields"})
    properties: dict[str, Any] = {
        "inputs": dict(pipeline.inputs),
        "slo_ms": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": MAX_SLO_MS,
                   "description": "this request's latency target, in milliseconds (default: the deployment's slo_ms)"},
        "stream": {"type": "boolean", "description": "true: a text/event-stream (its events: the 200's description)"},
        "steps": ({"type": "boolean", "description": "with stream: true, step events (or ?steps=true)"} if pipeline.steps
                  else {"const": False, "description": 'this deployment sends no step events (its steps option is "off")'}),
        "options": options_schema(pipeline.honoured),
        "field": field_schema,
    }
    needs_stream = {"if": {"required": ["steps"], "properties": {"steps": {"const": True}}},
                    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}}}
    return {"type": "object", "required": ["inputs"], "properties": properties, "additionalProperties": False,
            **needs_stream}


def _chat_body(served: Mapping[str, PipelineDoc]) -> dict[str, Any] | None:
    """The chat route's body: the one model's, or one of each model's that a chat request can be answered by."""
    bodies = [dict(pipeline.chat) for pipeline in served.values() if pipeline.chat is not None]
    if not bodies:
        return None
    return bodies[0] if len(bodies) == 1 else {"oneOf": bodies}


def _schema_of(shape: Any) -> dict[str, Any]:
    if isinstance(shape, tuple):  # one of these
        return _schema_of(shape[0]) if len(shape) == 1 else {"anyOf": [_schema_of(one) for one in shape]}
    if isinstance(shape, type) and shape.__name__ in _schemas():
        return {"$ref": SCHEMAS.format(model=shape.__name__)}
    return {"type": "object"}


@functools.cache
def _schemas() -> dict[str, Any]:
    """Every TypedDict the routes name, as JSON Schema (pydantic), their nested shapes included."""
    found: dict[str, Any] = {}
    for shape in (QueryReply, ChatRequest, ErrorReply, OpenAIError, Health, Readiness, OwnReadiness, Stats, PlanReport,
                  *STREAM_EVENTS):
        schema = TypeAdapter(shape).json_schema(ref_template=SCHEMAS)
        found.update(schema.pop("$defs", {}))
        found[shape.__name__] = schema
    found["QueryRequest"] = {"description": " ".join((QueryRequest.__doc__ or "").split()), **query_body(ANY_PIPELINE)}
    return found


# A query body of a pipeline the document does not know: `QueryRequest`, every constraint but the inputs' own.
ANY_PIPELINE = PipelineDoc({"type": "object", "description": "the pipeline's inputs by name (its own query path "
                            "names them); every one is required but those the deployment names in optional_inputs"},
                           honoured=None)


def _summary(handler: Any) -> str:
    text = inspect.getdoc(handler) or ""
    return text.splitlines()[0] if text else ""


def distribution_version() -> str:
    """The installed distribution's version (pyproject.toml's `name`): the document's `info.version`, the MCP server's."""
    try:
        return importlib.metadata.version("patchkit-rag")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
