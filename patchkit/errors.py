"""The exceptions patchkit raises, split by what the user can do about them.

    PatchkitError
    ├── CaptureError        fix the pipeline code: names your file, line and construct, with a hint
    ├── MakeError           @make or a Component is used wrongly (also a TypeError)
    ├── InputError          a pipeline input is unknown, missing or of the wrong type (also a TypeError)
    ├── ConfigError         a deploy() or `patchkit serve` option is unknown, out of range or conflicts (also a ValueError)
    ├── ComponentError      your component raised: carries its traceback text
    ├── CallError           a call's arguments or result could not cross to or from its worker: names the call and why
    ├── WorkerDiedError     the worker process serving a component died
    │   └── ComponentFailed it cannot start, or its workers cannot be replaced: its pipelines answer nothing until updated
    ├── DeadlineExceeded    a request ran past its deadline
    ├── Overloaded          admission is closed: carries the queue length and its limit
    ├── PipelineNotFound    a request named a pipeline the endpoint does not serve (also a LookupError)
    └── PlanError           no plan fits the resources or the SLO: says what is missing and how to declare it

    PlanWarning             a plan was made, but on less than it should be (a UserWarning, not an error)

Every one is importable from `patchkit` too. Errors cross process boundaries as JSON, never as pickles.

This module imports nothing from patchkit, so every part may raise these.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CallError",
    "CaptureError",
    "ComponentError",
    "ComponentFailed",
    "ConfigError",
    "DeadlineExceeded",
    "InputError",
    "MakeError",
    "Overloaded",
    "PatchkitError",
    "PipelineNotFound",
    "PlanError",
    "PlanWarning",
    "WorkerDiedError",
]


class PatchkitError(Exception):
    """Root of every error patchkit raises on purpose: `except patchkit.PatchkitError` catches them all.

    Over HTTP a request's error is `{"error": {"type": ..., "message": ...}}` with the status each error below
    names (HTTP 500 for one that names none), and `Endpoint` raises it again as the same type.
    """


class CaptureError(PatchkitError):
    """A `with patchkit.capture():` block holds code patchkit cannot turn into a pipeline.

    Raised by `patchkit.capture()` when the block is captured, before anything runs deployed; never over HTTP.
    The message names the user's file and line, the construct, and what to write instead.

    Attributes:
        construct: what could not be captured, as the message says it ("a `try` statement").
        filename: the user's file.
        lineno: the line in it, where known.
        hint: what to write instead.
    """

    def __init__(self, construct: str, *, filename: str, lineno: int | None, hint: str) -> None:
        self.construct = construct
        self.filename = filename
        self.lineno = lineno
        self.hint = hint
        where = f"{filename}:{lineno}" if lineno is not None else filename
        super().__init__(f"{where}: cannot capture {construct}. {hint}")


class MakeError(PatchkitError, TypeError):
    """`@make` or `Component` used in a way patchkit cannot serve; the message names the method.

    Raised where the mistake is made: when the decorator is applied, or when the component is built.
    """


class InputError(PatchkitError, TypeError):
    """A pipeline was called with an unknown, missing or ill-typed input; the message names it.

    Raised by `pipeline(...)`, and by the front-end for a request whose body or inputs are wrong: HTTP 400
    (413 for a body past `max_body_bytes`), which `Endpoint.query()` raises again as InputError.
    """


class ConfigError(PatchkitError, ValueError):
    """A deployment option is unknown, out of range, or conflicts with another.

    The message names it, suggests the closest known name for a misspelt one, and gives both values of a
    conflict. Raised by `deploy()`, `plan()`, `Endpoint.update()` and `patchkit serve` where the options are
    given, before anything starts.
    """


class ComponentError(PatchkitError):
    """A component method raised (HTTP 500, with the component's error text).

    Raised by the request whose pipeline code did not catch the component's exception, or, for code that
    catches it, that exception itself as plain Python would see it.

    Attributes:
        component: the component's name in the deployment.
        method: the method that raised.
        traceback_text: the component's own traceback, as text (empty where the endpoint sent none: it
            sends it with `debug=True` only).
    """

    def __init__(self, component: str, method: str, message: str, traceback_text: str = "") -> None:
        self.component = component
        self.method = method
        self.traceback_text = traceback_text
        super().__init__(f"{component}.{method} raised: {message}")


class CallError(PatchkitError):
    """A component call failed between the front-end and its worker, not in the component.

    Its arguments could not be pickled or unpickled, or its result could not be. Only that call (or, for a
    reply that cannot be read, that batch) fails; the worker keeps serving. Raised by the request that made the
    call (HTTP 500).

    Attributes:
        component: the component's name in the deployment.
        method: the method called.
    """

    def __init__(self, component: str, method: str, message: str) -> None:
        self.component = component
        self.method = method
        super().__init__(f"{component}.{method}: {message}")


class WorkerDiedError(PatchkitError):
    """The worker process serving a component died while it held a call, or could not start.

    Raised by a request whose call was on a replica that died once the call's retries (`max_retries`, or the
    method's `retries`) are spent (HTTP 500), and by `deploy()` or `Endpoint.update()` when a worker could not
    start (its stderr, above the error, says why).
    """


class ComponentFailed(WorkerDiedError):
    """A component cannot serve: it could not start at deploy, or its replicas could not be started again.

    Its replicas crashed in native code at every restart, or their restarts failed in a row. patchkit stopped
    starting it: raised at once by every request of a pipeline that calls it (HTTP 503) until it is replaced or
    the deployment is updated; that pipeline's readiness (`/v1/pipelines/{name}/readyz`) is "failed" meanwhile,
    while the other pipelines serve. The message names the pipeline, the component and why (a signal points at
    `patchkit doctor`).
    """


class DeadlineExceeded(PatchkitError):
    """A request ran past its deadline (its SLO, or the endpoint's `request_timeout_s`).

    Raised by the request (HTTP 504), whose calls still queued are withdrawn, and by `Endpoint.query()` when no
    answer came within the endpoint's timeout. A component's own TimeoutError is its error (500), never this.
    """


class Cancelled(PatchkitError):
    """A request ended before its call did (its client went away, or its caller cancelled it).

    The call was withdrawn from its queue or aborted where it ran.
    """


class Overloaded(PatchkitError):
    """Admission is closed because the admission queue is full (HTTP 503, with Retry-After).

    Raised by a request refused at the door: the requests or body bytes in flight are at their limits, the
    workers are still starting, or the server is draining. Retry after the header's seconds.

    Attributes:
        queue_length: the requests waiting when this one was refused.
        limit: the most that may wait (`admission_queue_limit`, or `max_inflight_requests`).
    """

    def __init__(self, queue_length: int, limit: int, reason: str | None = None) -> None:
        self.queue_length = queue_length
        self.limit = limit
        super().__init__(reason or f"admission queue is full ({queue_length} waiting, limit {limit}); retry later")


class PipelineNotFound(PatchkitError, LookupError):
    """A request named a pipeline the endpoint does not serve (HTTP 404); the message lists those it does.

    Raised by `endpoint[name]`'s calls and by `POST /v1/pipelines/{name}/query` for a name not served.
    """

    def __init__(self, name: str, served: list[str] | None = None) -> None:
        self.name = name
        known = f": it serves {', '.join(served)} (GET /v1/pipelines)" if served else ""
        super().__init__(f"no pipeline named {name!r}{known}")


class PlanError(PatchkitError):
    """The planner found no plan: the resources or the SLO cannot hold the pipeline.

    Raised by `plan()`, `deploy()` and `patchkit plan` before anything serves; never over HTTP. The message says
    what is missing (which components, how many units of which resource) and what to declare.
    """


class PlanWarning(UserWarning):
    """A plan was made on less than it should be.

    A method the calibration inputs never reached was profiled with inputs taken elsewhere; the message
    names the method and where its inputs came from.
    """


def error_to_json(error: BaseException, *, traceback: bool = True) -> dict[str, Any]:
    """The JSON form of an error: its type name, message and, for component errors, where it came from.

    Args:
        error: the error to send.
        traceback: False leaves out a component error's traceback (the HTTP API's replies, unless the
            deployment has `debug=True`): its paths and source lines stay on the server.

    Returns:
        A JSON-able dict, which `error_from_json` reads back.
    """
    payload: dict[str, Any] = {"type": type(error).__name__, "message": str(error)}
    if isinstance(error, ComponentError):
        payload.update(component=error.component, method=error.method)
        if traceback:
            payload["traceback"] = error.traceback_text
    elif isinstance(error, CallError):
        payload.update(component=error.component, method=error.method)
    elif isinstance(error, Overloaded):
        payload.update(queue_length=error.queue_length, limit=error.limit)
    return payload


def error_from_json(payload: dict[str, Any]) -> PatchkitError:
    """Rebuild an error sent by `error_to_json` in another process, as the closest patchkit error.

    Args:
        payload: what `error_to_json` made.

    Returns:
        The error, of the same type where it is a public one (a component error sent without its traceback
        has an empty `traceback_text`), else a `PatchkitError` with its message.
    """
    kind, message = payload.get("type", ""), str(payload.get("message", ""))
    if kind == "ComponentError":
        error = ComponentError(payload.get("component", "?"), payload.get("method", "?"), "", payload.get("traceback", ""))
        error.args = (message,)
        return error
    if kind == "CallError":
        call_error = CallError(payload.get("component", "?"), payload.get("method", "?"), "")
        call_error.args = (message,)
        return call_error
    if kind == "PipelineNotFound":
        not_found = PipelineNotFound("")
        not_found.args = (message,)
        return not_found
    if kind == "Overloaded":
        return Overloaded(int(payload.get("queue_length", 0)), int(payload.get("limit", 0)), message)
    known: dict[str, type[PatchkitError]] = {
        "InputError": InputError,
        "ConfigError": ConfigError,
        "WorkerDiedError": WorkerDiedError,
        "ComponentFailed": ComponentFailed,
        "DeadlineExceeded": DeadlineExceeded,
        "MakeError": MakeError,
        "PlanError": PlanError,
        "CaptureError": PatchkitError,
    }
    return known.get(kind, PatchkitError)(message)


def unknown_input(name: str, known: Mapping[str, Any]) -> InputError:
    """The error for an input the pipeline does not have, with the closest known name."""
    close = difflib.get_close_matches(name, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return InputError(f"unknown pipeline input {name!r}{hint} (inputs: {', '.join(sorted(known)) or 'none'})")
