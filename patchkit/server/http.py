"""The front-end's HTTP API (JSON only; nothing a client sends is ever unpickled).

    POST /v1/pipelines/{name}/query   {"inputs": {...}, "slo_ms"?: n, "stream"?: bool, "options"?: {...},
                     "field"?: str} -> {"output", "request_id", "latency_ms"}, run on pipeline `name`'s version as
                     of its arrival (named in the `X-Pipeline-Version` header); "options": sampling options
                     (max_tokens, stop, seed, ...) for the call whose result is the output (of a dict output,
                     its "field"), refused (400) where that call does not honour them; with "stream": true a
                     text/event-stream: `data: {"delta": "..."}` per text chunk of the output's streaming call
                     (`"field"` naming its field where a dict output has several streamed ones), then
                     `data: {"output", "request_id", "latency_ms"}`, or, for an error after the stream
                     started, `event: error` + `data: {"error": {...}, "request_id"}`; then always, last,
                     `event: end` + `data: {"request_id", "status": "ok" | "error"}`. With "steps": true
                     too (or `?steps=true`), an `event: step` + `data: {"step": {...}}` as each component
                     call starts and ends (serving/steps.py), as the deployment's `steps` option allows:
                     "timings" (the default) without previews, "previews" with them, "off" a 400
    POST /v1/query   the same, on the only pipeline (400 where several are served)
    GET  /v1/pipelines   each pipeline served: name, version, digest, inputs, input_schema, output, state, components
    POST /v1/chat/completions, GET /v1/models   the OpenAI chat API, a pipeline per model (chat.py)
    GET  /health     as vLLM's: 200 with an empty body once every component has a replica passing its
                     health checks, else 503 (what load generators such as GuideLLM probe)
    GET  /healthz    liveness: 200 whenever the process answers, from before its workers start until it
                     stops; whether every component has a replica passing its health checks ("workers":
                     "ok" or "degraded"), requests and body bytes in flight
    GET  /readyz     readiness: 200 while every pipeline that is not failed is ready ("ready", or "degraded"
                     where some are failed); 503 while the workers start, while a component a pipeline not
                     failed calls has no replica serving (each being replaced, its restart perhaps failing, or
                     failing its health checks), where every pipeline is failed, and while draining
                     (`Frontend.readiness`); its body names each pipeline ("pipelines") and each component not
                     wholly ready ("components"), with why
    GET  /v1/pipelines/{name}/readyz   pipeline `name`'s own readiness (`Frontend.pipeline_readiness`): 200
                     ready, 503 starting, unready, failed or draining, with why; 404 for a name not served.
                     The probes never ask for the token.
    GET  /metrics    Prometheus text (server/metrics.py)
    GET  /v1/graph, /v1/pipelines/{name}/graph   the captured graph (of the only pipeline, or of `name`)
    GET  /v1/plan    the deployment's configuration (`DeploymentConfig.describe`, an allow-list) and its inputs
    GET  /v1/stats   per component: replicas, batches, throughput, queues (`Endpoint.stats()`)
    GET  /v1/traces  the last finished requests with an SLO
    GET  /, /dashboard, /v1/activity, /v1/graph.svg   the dashboard (server/dashboard/), its files public
    GET  /openapi.json   this API as an OpenAPI 3.1 document (openapi.py): a query path and body per pipeline
    GET, POST, DELETE /mcp   the pipelines as MCP tools over Streamable HTTP, a tools/call run as a query (mcp/)

Every reply carries the request's id in its `X-Request-ID` header: the client's own (1 to 200
printable ASCII characters, else 400), else a fresh one; query replies and errors carry it in their
body too (`request_id`).

Errors are `{"error": {"type", "message", ...}, "request_id"}`: 400 bad input, 401 without the deployment's bearer
token, 404 and 405 (with Allow), 408 a body that took longer than `read_timeout_s`, 413 body too
large, 415 a Content-Encoding other than gzip or deflate, 503 with Retry-After when admission is
closed (requests or body bytes in flight, the workers still starting, the server draining), 504
past the request timeout, 500 with the component's
error. Replies carry no traceback unless the deployment has `debug=True`. Each 4xx is logged as one
WARNING line naming the route, the status and the message.
"""

from __future__ import annotations

import hmac
import json
import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from patchkit.errors import InputError
from patchkit.server.bodies import BodyBudget, announced_size, decode, read_within
from patchkit.server.chat import ChatRoutes
from patchkit.server.dashboard import DashboardRoutes, is_public
from patchkit.server.events import ERROR_EVENT, STEP_EVENT, EventStream, pump
from patchkit.server.inputs import InputSchema, QueryBody, output_json, steps_wanted
from patchkit.server.loop_lag import LoopLag
from patchkit.server.mcp import McpRoutes
from patchkit.server.metrics import CONTENT_TYPE, DeploymentMetrics
from patchkit.server.openapi import PipelineDoc, document
from patchkit.server.replies import REQUEST_ID_HEADER, error_reply, json_reply, request_id_of, set_request_id
from patchkit.server.request_ids import REQUEST_ID, check_request_id, new_request_id
from patchkit.serving.frontend import Frontend, RequestResult, Version
from patchkit.serving.runner import FieldDelta, outcome_of
from patchkit.serving.steps import StepEvent

__all__ = ["build_app", "error_reply", "input_schema_field"]

logger = logging.getLogger(__name__)

# The error type of a reply aiohttp's routing or the edge's own checks refuse: the body's faults
# are the client's input (Endpoint.query raises InputError), the rest name the HTTP status.
_HTTP_ERRORS = {400: "InputError", 401: "Unauthorized", 404: "NotFound", 405: "MethodNotAllowed",
                408: "RequestTimeout", 413: "InputError", 415: "InputError"}
_FRONTEND = web.AppKey("frontend", Frontend)
_SCHEMAS = web.AppKey("schemas", weakref.WeakKeyDictionary)  # Version -> its InputSchema
_METRICS = web.AppKey("metrics", DeploymentMetrics)
_BODIES = web.AppKey("bodies", BodyBudget)
_CHAT = web.AppKey("chat", ChatRoutes)
_ROUTES = ("POST /v1/query, /v1/pipelines/{name}/query, /v1/chat/completions, GET /health, /healthz, /readyz, /metrics, "
           "/v1/pipelines, /v1/graph, /v1/plan, /v1/stats, /v1/traces, /v1/activity, /v1/models, /dashboard, /openapi.json, /mcp")
VERSION_HEADER = "X-Pipeline-Version"
_PROBES = ("/health", "/healthz", "/readyz", "/v1/pipelines/{name}/readyz")  # answered from the start, without the token


def _json(status: int, payload: Any, headers: dict[str, str] | None = None) -> web.Response:
    return json_reply(status, payload, headers)


def _refuse(request: web.Request, status: int, error: dict[str, Any], headers: dict[str, str] | None = None) -> web.Response:
    """An error reply; a 4xx (the client's doing) is one WARNING line, with no traceback."""
    if status < 500:  # the path as sent (a decoded one may hold a newline), the message on one line
        message = " ".join(str(error.get("message", "")).split())
        logger.warning("%s %s: %d %s", request.method, request.rel_url.raw_path, status, message)
    return _json(status, {"error": error, "request_id": request_id_of(request)}, headers)


def _error(request: web.Request, error: BaseException) -> web.Response:
    status, payload = error_reply(error, debug=request.app[_FRONTEND].config.server.debug)
    return _refuse(request, status, payload["error"], {"Retry-After": "1"} if status == 503 else None)


@web.middleware
async def _edge(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Every route: the request's id (the client's X-Request-ID, checked, else a fresh one) set for
    its logs and returned in its reply's header; the bearer token (but the probes); then, while the workers
    start, 503 (but the probes); then aiohttp's own refusals (404, 405, and the 408, 413 and 415 the query
    route raises) as JSON errors."""
    given = request.headers.get(REQUEST_ID_HEADER)
    response: web.StreamResponse
    try:
        request_id = new_request_id() if given is None else check_request_id(given)
    except InputError as exc:
        request_id = None
        set_request_id(request, new_request_id())
        response = _refuse(request, 400, {"type": "InputError", "message": str(exc)})
    if request_id is not None:
        set_request_id(request, request_id)
        token = REQUEST_ID.set(request_id)
        try:
            response = await _guarded(request, handler)
        finally:
            REQUEST_ID.reset(token)
    if not response.prepared:  # a stream sets its own, before its first event
        response.headers[REQUEST_ID_HEADER] = request_id_of(request)
    return response


async def _guarded(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    frontend = request.app[_FRONTEND]
    token = frontend.config.server.auth_token
    public = _is_probe(request) or is_public(request.path)  # the dashboard's files hold no data
    if token is not None and not public and not _authorized(request, token):
        message = "this endpoint needs the deployment's token: send the header 'Authorization: Bearer <auth_token>'"
        challenge = {"WWW-Authenticate": 'Bearer realm="patchkit"'}
        return _refuse(request, 401, {"type": "Unauthorized", "message": message}, challenge)
    if not frontend.started and not public:
        message = "the endpoint is starting: its workers are not all up yet (GET /readyz says when they are)"
        return _refuse(request, 503, {"type": "Starting", "message": message}, {"Retry-After": "1"})
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        if exc.status == 404:
            message = f"no route {request.method} {request.rel_url.raw_path}; the API serves {_ROUTES}"
        elif exc.status == 405:
            message = f"{request.rel_url.raw_path} takes {exc.headers.get('Allow', '')}, not {request.method}"
        else:
            message = exc.text or exc.reason
        kind = _HTTP_ERRORS.get(exc.status, exc.reason.replace(" ", ""))
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        response = _refuse(request, exc.status, {"type": kind, "message": message}, headers)
        if exc.status in (408, 413):  # the body was not read to its end
            response.force_close()
        return response


def _is_probe(request: web.Request) -> bool:
    """Whether the route `request` reached is a probe (`_PROBES`, by the route's path as registered)."""
    resource = request.match_info.route.resource
    return request.path in _PROBES or (resource is not None and resource.canonical in _PROBES)


def _authorized(request: web.Request, token: str) -> bool:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


async def read_body(request: web.Request, run: Callable[[bytes], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    """Read the request's body, bounded in size and time and counted in flight, and answer `run(body)`.

    Used by every route that takes a body: a body too large or too slow raises the HTTP error `_edge`
    answers; `run`'s own errors are its to answer."""
    frontend, bodies = request.app[_FRONTEND], request.app[_BODIES]
    limit = frontend.config.limits.max_body_bytes
    held = 0  # the body's bytes counted in flight, from its headers until the request ends
    try:
        held = bodies.hold(announced_size(request, limit))
        body = decode(request, await read_within(request, frontend.config.server.read_timeout_s, limit), limit)
        held = bodies.hold(len(body), held)
        return await run(body)
    except (web.HTTPException, ConnectionResetError):
        raise  # a 408, 413 or 415: `_edge` replies; or the client of a stream went away
    except Exception as exc:
        return _error(request, exc)
    finally:
        bodies.release(held)


async def query(request: web.Request) -> web.StreamResponse:
    """`POST /v1/query` (the only pipeline) and `POST /v1/pipelines/{name}/query`: on the version serving as it arrives."""
    async def run(body: bytes) -> web.StreamResponse:
        version = request.app[_FRONTEND].route(request.match_info.get("name"))
        parsed = schema_of(request.app, version).parse(body)
        steps = steps_wanted(parsed, request.query.get("steps"), request.app[_FRONTEND].config.server.steps)
        _check_options(version, parsed)
        if parsed.stream:
            return await _stream_query(request, version, parsed, steps)
        result = await version.runner.query(parsed.inputs, parsed.slo_ms, request_id=request_id_of(request),
                                            options=parsed.options, field=parsed.field)
        return web.Response(body=_result_json(result), content_type="application/json",
                            headers={VERSION_HEADER: result.version or version.tag})  # the version that ran it

    return await read_body(request, run)


def _check_options(version: Version, parsed: QueryBody) -> None:
    """A body's `field`, one the output has, and its options, each honoured by the call that answers (of that
    field); InputError names what is not."""
    fields = version.pipeline.graph.output_fields
    if parsed.field is not None and fields and parsed.field not in fields:
        raise InputError(f"field names {parsed.field!r}, which the output does not have: its fields are {', '.join(fields)}")
    if parsed.options is None:
        return
    honoured = version.runner.honoured(parsed.field)
    for name in parsed.options.given():
        if name not in honoured:
            which = f"field {parsed.field!r} of the output" if parsed.field is not None else "the output"
            also = f" (it honours {', '.join(sorted(honoured))})" if honoured else ""
            raise InputError(f"options.{name} cannot be honoured: the call that makes {which} does not take it{also}; "
                             "leave it out, or give the pipeline an input of its own for it")


def schema_of(app: web.Application, version: Version) -> InputSchema:
    """The inputs `version`'s pipeline takes, checked at the edge."""
    schemas = app[_SCHEMAS]
    if version not in schemas:
        schemas[version] = InputSchema(version.pipeline.inputs, app[_FRONTEND].config.server.optional_inputs)
    schema: InputSchema = schemas[version]
    return schema


def _result_json(result: RequestResult) -> bytes:
    """The reply to a query, and the last event of a streamed one."""
    return b'{"output": %s, "request_id": %s, "latency_ms": %.3f}' % (
        output_json(result.output), json.dumps(result.request_id).encode(), result.latency_s * 1000)


async def _stream_query(request: web.Request, version: Version, parsed: QueryBody, steps: bool = False) -> web.StreamResponse:
    """`"stream": true`: a `data: {"delta": ...}` event per chunk, then the reply, then `event: end`; with `steps`,
    an `event: step` as each call starts and ends, among them in the order they happened.

    An error before the first event is the usual JSON error; after it, an `event: error` before the end."""
    request_id = request_id_of(request)
    stream = EventStream(request, {REQUEST_ID_HEADER: request_id, VERSION_HEADER: version.tag})

    async def send_delta(item: str | FieldDelta | StepEvent) -> None:
        if isinstance(item, FieldDelta):
            await stream.send(json.dumps({"delta": item.text, "field": item.field}).encode())
        elif isinstance(item, str):
            await stream.send(json.dumps({"delta": item}).encode())
        else:
            await stream.send(json.dumps({"step": item}).encode(), STEP_EVENT)

    def run(report: Callable[[Any], object]) -> Awaitable[RequestResult]:
        return version.runner.query(parsed.inputs, parsed.slo_ms, request_id=request_id, on_delta=report,
                                    on_step=report if steps else None, options=parsed.options, field=parsed.field)

    try:
        result = await pump(run, send_delta)
        await stream.send(_result_json(result))
    except ConnectionResetError:
        raise  # the client went away: nobody to answer
    except Exception as exc:
        if not stream.started:
            raise
        _, payload = error_reply(exc, debug=request.app[_FRONTEND].config.server.debug)
        await stream.send(json.dumps({**payload, "request_id": request_id}).encode(), ERROR_EVENT)
        return await stream.end(request_id, ok=False)
    return await stream.end(request_id, ok=True)


async def healthz(request: web.Request) -> web.Response:
    """Liveness: the process answers, so 200 whatever its workers do (the supervisor replaces those)."""
    frontend = request.app[_FRONTEND]
    workers = "ok" if frontend.started and frontend.healthy() else "degraded"
    reply = {"status": "ok", "workers": workers, "inflight": frontend.inflight,
             "inflight_bytes": request.app[_BODIES].held}
    return _json(200, reply)


async def health(request: web.Request) -> web.Response:
    """vLLM's probe: 200 and no body while every component has a healthy replica, else 503 saying why."""
    frontend = request.app[_FRONTEND]
    if frontend.started and frontend.healthy():
        return web.Response(status=200)
    why = "the workers are still starting" if not frontend.started else "a component has no healthy replica"
    return _json(503, {"status": "unhealthy", "reason": why})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 while every pipeline that is not failed is ready and the server is not draining, else 503;
    the body says why, by pipeline and by component."""
    readiness = request.app[_FRONTEND].readiness()
    return _json(200 if readiness.ready else 503, readiness.to_json())


async def pipeline_readyz(request: web.Request) -> web.Response:
    """Pipeline `name`'s readiness: 200 while it is ready, else 503 with why; 404 for a name not served."""
    try:
        readiness = request.app[_FRONTEND].pipeline_readiness(request.match_info["name"])
    except Exception as exc:
        return _error(request, exc)
    return _json(200 if readiness.ready else 503, readiness.to_json())


async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=await request.app[_METRICS].scrape(), headers={"Content-Type": CONTENT_TYPE})


async def graph(request: web.Request) -> web.Response:
    """`GET /v1/graph` (the only pipeline's) and `GET /v1/pipelines/{name}/graph`."""
    try:
        version = request.app[_FRONTEND].route(request.match_info.get("name"))
    except Exception as exc:
        return _error(request, exc)
    return _json(200, version.pipeline.graph.to_json())


async def pipelines(request: web.Request) -> web.Response:
    """Each pipeline served, as `Frontend.describe` lists them, with the JSON Schema of its inputs."""
    return _json(200, {"pipelines": request.app[_FRONTEND].describe(input_schema_field(request.app))})


def input_schema_field(app: web.Application) -> Callable[[Version], dict[str, Any]]:
    """The field the server adds to each version's row of `Frontend.describe` (`GET /v1/pipelines`, and
    `Endpoint.update()`'s reply): `input_schema`, the JSON Schema of its inputs, which the dashboard's form is
    built from."""
    def field(version: Version) -> dict[str, Any]:
        return {"input_schema": schema_of(app, version).json_schema()}

    return field


async def plan(request: web.Request) -> web.Response:
    """The config (an allow-list), and the inputs of each pipeline; of the only one as `inputs` too."""
    frontend = request.app[_FRONTEND]
    inputs = {name: schema_of(request.app, version).describe() for name, version in frontend.versions.items()}
    only = {"inputs": next(iter(inputs.values()))} if len(inputs) == 1 else {}
    return _json(200, {**frontend.config.describe(), **only, "pipelines": inputs})


async def stats(request: web.Request) -> web.Response:
    frontend = request.app[_FRONTEND]
    data = frontend.stats()
    if request.query.get("replicas") == "1":
        data["replica_reports"] = await frontend.replica_stats()
    return _json(200, data)


async def traces(request: web.Request) -> web.Response:
    """The last finished requests with an SLO, as the estimators saw them (timings and sizes only)."""
    return _json(200, {"traces": [trace.to_dict() for trace in request.app[_FRONTEND].policy.finished]})


async def openapi(request: web.Request) -> web.Response:
    """This API as an OpenAPI 3.1 document: the routes served, and each pipeline's own query body."""
    frontend = request.app[_FRONTEND]
    routes = [(route.method, route.resource.canonical, route.handler) for route in request.app.router.routes()
              if route.resource is not None]
    several = len(frontend.versions) > 1
    served = {name: _pipeline_doc(request.app, name, version, several) for name, version in frontend.versions.items()}
    return _json(200, document(routes, pipelines=served, auth=frontend.config.server.auth_token is not None))


def _pipeline_doc(app: web.Application, name: str, version: Version, several: bool) -> PipelineDoc:
    """What `/openapi.json` says of pipeline `name`: its inputs, its output's fields, the options its answering call
    honours (for any field asked), whether steps are offered, and its chat body."""
    fields = tuple(version.pipeline.graph.output_fields)
    honoured = frozenset.intersection(*(version.runner.honoured(f) for f in (None, *fields)))
    return PipelineDoc(schema_of(app, version).json_schema(), fields, honoured,
                       app[_FRONTEND].config.server.steps != "off", app[_CHAT].body_schema(name, version, several))


def build_app(frontend: Frontend, loop_lag: LoopLag | None = None) -> web.Application:
    """The routes over `frontend`; `/metrics` shows `loop_lag` too when the server measures it."""
    app = web.Application(client_max_size=frontend.config.limits.max_body_bytes, middlewares=[_edge])
    app[_FRONTEND] = frontend
    count = frontend.collector.count
    app[_BODIES] = BodyBudget(frontend.config.limits.max_inflight_bytes, lambda refused: count(outcome_of(refused)))
    app[_METRICS] = DeploymentMetrics(frontend.snapshot, frontend.replica_stats, loop_lag)
    app[_SCHEMAS] = weakref.WeakKeyDictionary()
    app.router.add_post("/v1/query", query)
    app.router.add_post("/v1/pipelines/{name}/query", query)
    app.router.add_get("/v1/pipelines", pipelines)
    app.router.add_get("/v1/pipelines/{name}/graph", graph)
    app.router.add_get("/health", health)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/v1/pipelines/{name}/readyz", pipeline_readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/graph", graph)
    app.router.add_get("/v1/plan", plan)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/v1/traces", traces)
    app.router.add_get("/openapi.json", openapi)
    app[_CHAT] = ChatRoutes(frontend, read_body)
    app[_CHAT].add_to(app.router)
    DashboardRoutes(frontend).add_to(app.router)
    McpRoutes(frontend, read_body, lambda version: schema_of(app, version)).add_to(app)
    return app
