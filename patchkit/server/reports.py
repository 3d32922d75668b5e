"""The shapes of what the HTTP routes report, as TypedDicts.

`GET /v1/stats` (`Endpoint.stats()`), `GET /v1/plan` (`Endpoint.plan()`), `POST /v1/query`'s reply and every route's
error.

They describe the JSON the routes serve; the values themselves are plain dicts, built by `serving/stats.py`,
`config/deployment.py` (`DeploymentConfig.describe`) and the routes. The client's methods are annotated with them,
so the reference shows each field, and the OpenAPI document (`GET /openapi.json`) is made from them. This module
imports nothing from patchkit, so the client reads it without loading the server.
"""

from __future__ import annotations

from typing import (
    Any,
    Literal,
    NotRequired,  # pydantic reads its schema (the OpenAPI document) before 3.12
)

from typing_extensions import TypedDict

__all__ = ["ComponentStats", "ErrorBody", "ErrorReply", "MethodStats", "PlanReport", "QueryReply", "ReplacedReplica",
           "ReplicaStats", "RequestCounts", "Stats"]


class MethodStats(TypedDict):
    """One `@make` method of a component, as `stats()["components"][name]["methods"][method]` reports it."""

    batch_size: int
    """The batch size its queue sends (a plan's, deploy()'s or the method's own)."""
    queue_length: int
    """Calls waiting in its queue now."""
    calls: int
    """Calls sent to its replicas so far."""
    batches: int
    """Batches sent so far."""
    mean_batch: float
    """Calls per batch, on average."""
    throughput_per_s: float
    """Calls answered per second, lately."""
    mean_queue_wait_ms: float
    """How long a call waited in the queue before its batch left, on average."""
    mean_batch_ms: float
    """How long a batch took on its replica, on average."""
    failures: int
    """Calls that failed."""
    retries: int
    """Calls sent again after their replica died or got stuck."""


class ReplicaStats(TypedDict):
    """One replica of a component, in service or being replaced."""

    id: str
    """Its id, as logs, metrics and `replica_reports` name it."""
    pid: int | None
    """Its worker process (None on the inprocess backend, or before it started)."""
    address: str | None
    """Where its worker listens (None on the inprocess backend)."""
    alive: bool
    """Whether it takes batches now."""
    state: str
    """"starting", "ready", "draining", "stopped", ... (ReplicaState's values)."""
    health: str
    """"ok", or how many health checks in a row it failed and why."""
    inflight_batches: int
    """Batches sent to it and not yet answered."""
    resources: dict[str, Any]
    """The cores, threads, GPU and memory share it was given."""
    why: NotRequired[str]
    """Why it is out of service, where it is."""


class ReplacedReplica(TypedDict):
    """A replica replaced lately (dead, stuck, unhealthy), and why."""

    id: str
    """Its id."""
    state: str
    """What it was when replaced: "dead", "stuck", "unhealthy", ..."""
    why: str
    """Why, in words (its exit, the call that got stuck, the failed checks)."""
    at: float
    """When, in seconds since the epoch."""


# "class" is a keyword: its component's class's name, a key of the functional form.
_ComponentClass = TypedDict("_ComponentClass", {"class": str})


class ComponentStats(_ComponentClass):
    """One deployed component, as `stats()["components"][name]` reports it: `class` (its class's name) and these."""

    replicas: list[ReplicaStats]
    """Its replicas in service, then those out of it until another replaces each."""
    methods: dict[str, MethodStats]
    """By method name."""
    replaced: list[ReplacedReplica]
    """Its replicas replaced lately."""
    state: Literal["serving", "failed"]
    """"failed" where it could not start, or its workers died and could not be started again (its pipelines answer
    ComponentFailed, HTTP 503), until an update."""
    failed: NotRequired[str]
    """Why it failed, where it did."""


class RequestCounts(TypedDict, total=False):
    """Requests by how they ended, those in flight, and the mean latency of those answered.

    How a request ends: "ok", "timeout", "overloaded", "worker_died", "cancelled" or "error"; a count appears
    once a request ended so.
    """

    inflight: int
    """Requests running now."""
    ok: int
    """Requests answered."""
    timeout: int
    """Requests past their deadline (504)."""
    overloaded: int
    """Requests refused at admission (503)."""
    worker_died: int
    """Requests failed by a worker that died, or by a failed component."""
    cancelled: int
    """Requests whose client went away."""
    error: int
    """Requests that failed otherwise (a component raised: 500)."""
    mean_latency_ms: float
    """The mean latency of the requests answered, present once one was."""


class Stats(TypedDict):
    """What `Endpoint.stats()` returns (`GET /v1/stats?replicas=1`)."""

    backend: str
    """"local", "ray" or "inprocess"."""
    uptime_s: float
    requests: RequestCounts
    pipelines: dict[str, dict[str, dict[str, int]]]
    """By pipeline name, by version: requests by how they ended."""
    restarts: int
    """Replicas started again after they died."""
    slo: dict[str, Any]
    """The SLO policy's counters (requests at risk, admission pauses, ...)."""
    prefetch: dict[str, Any]
    """Lookahead prefetch's counters, where a retriever has it."""
    components: dict[str, ComponentStats]
    """By component name."""
    replica_reports: NotRequired[dict[str, dict[str, Any]]]
    """By replica id, what each reports of itself: pid, pinning, batches run, its component's own `stats()`."""


class PlanReport(TypedDict, total=False):
    """What `Endpoint.plan()` returns (`GET /v1/plan`).

    Besides these keys, every option that `/v1/plan` shows (those the Options page marks as reported: never a
    path, a key or the environment), by its flat name.
    """

    plan: dict[str, Any] | None
    """The Plan applied (`Plan.to_dict()`), or None where replicas and batch sizes were given or defaulted."""
    components: dict[str, dict[str, Any]]
    """By component name: its replicas, batch size, resources (`ComponentConfig`)."""
    inputs: dict[str, str]
    """The only pipeline's inputs and their JSON kinds (present where one pipeline is served)."""
    pipelines: dict[str, dict[str, str]]
    """By pipeline name: its inputs and their JSON kinds."""


class QueryReply(TypedDict):
    """`POST /v1/query`'s reply, where `Endpoint.query()` returns its `output`."""

    output: Any
    """What the pipeline returned, as JSON."""
    request_id: str
    """The request's id (its X-Request-ID)."""
    latency_ms: float
    """How long the front-end took, from arrival to the answer."""


class ErrorBody(TypedDict):
    """What went wrong, in words a client can act on."""

    type: str
    """The error's type: an error of patchkit.errors (InputError, ComponentError, ...) or the HTTP refusal's."""
    message: str


class ErrorReply(TypedDict):
    """Every error: its type and message, never a traceback unless the deployment has debug=True."""

    error: ErrorBody
    request_id: NotRequired[str]
