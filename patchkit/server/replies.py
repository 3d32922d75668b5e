"""What the HTTP routes answer with: JSON replies, and the status and JSON of what ended a request.

Shared by the query routes (http.py) and the OpenAI chat routes (chat.py).
"""

from __future__ import annotations

import json
import traceback
from typing import Any

from aiohttp import web

from patchkit.errors import (
    ComponentError,
    ComponentFailed,
    DeadlineExceeded,
    InputError,
    Overloaded,
    PatchkitError,
    PipelineNotFound,
    WorkerDiedError,
    error_to_json,
)

__all__ = ["REQUEST_ID_HEADER", "error_reply", "json_reply", "request_id_of"]

REQUEST_ID_HEADER = "X-Request-ID"
_REQUEST_ID = web.RequestKey("request_id", str)  # where the edge keeps the request's id on the aiohttp request
_STATUS: list[tuple[type[BaseException], int]] = [
    (InputError, 400), (PipelineNotFound, 404), (Overloaded, 503), (ComponentFailed, 503), (DeadlineExceeded, 504)
]


def error_reply(error: BaseException, *, debug: bool = False) -> tuple[int, dict[str, Any]]:
    """The status and JSON error for what ended a request; a traceback only with `debug`."""
    origin = getattr(error, "__patchkit_origin__", None)
    if origin is not None and not isinstance(error, WorkerDiedError):
        # A component's own exception, raised again inside the pipeline code and not caught there.
        component, method, text = origin
        error = ComponentError(component, method, f"{type(error).__name__}: {error}", text)
    elif not isinstance(error, PatchkitError):
        text = "".join(traceback.format_exception(error))
        error = ComponentError("pipeline", "run", f"{type(error).__name__}: {error}", text)
    status = next((code for kind, code in _STATUS if isinstance(error, kind)), 500)
    return status, {"error": error_to_json(error, traceback=debug)}


def json_reply(status: int, payload: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=json.dumps(payload).encode(), content_type="application/json", headers=headers)


def request_id_of(request: web.Request) -> str:
    """The request's id, as the edge set it (`set_request_id`) before any route ran."""
    request_id: str = request[_REQUEST_ID]
    return request_id


def set_request_id(request: web.Request, request_id: str) -> None:
    request[_REQUEST_ID] = request_id
