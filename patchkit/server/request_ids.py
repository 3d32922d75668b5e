"""Request ids: kept from the client's `X-Request-ID` or made fresh, and carried in log records.

The HTTP edge sets `REQUEST_ID` while it serves a request, on the request's task; the pipeline's
greenlet runs in a copy of that task's context (`serving/bridge.py`), so `RequestIdFilter`,
installed on a handler, stamps every record logged on the request's behalf with `record.request_id`
("-" outside any request).
"""

from __future__ import annotations

import logging
import uuid
from contextvars import ContextVar

from patchkit.errors import InputError

__all__ = ["MAX_REQUEST_ID_LENGTH", "REQUEST_ID", "RequestIdFilter", "check_request_id", "new_request_id"]

MAX_REQUEST_ID_LENGTH = 200
REQUEST_ID: ContextVar[str | None] = ContextVar("patchkit_request_id", default=None)


def new_request_id() -> str:
    """A fresh id, unique across processes and restarts: a uuid4 in hex."""
    return uuid.uuid4().hex


def check_request_id(value: str) -> str:
    """A client's `X-Request-ID`, as given: 1 to 200 printable ASCII characters, else InputError (a 400).

    ASCII only, so that the id can travel back in a reply header and into log lines unchanged."""
    if not 0 < len(value) <= MAX_REQUEST_ID_LENGTH or not all(" " <= c <= "~" for c in value):
        shown = f"{len(value)} characters" if len(value) > MAX_REQUEST_ID_LENGTH else repr(value[:40])
        raise InputError(f"the X-Request-ID header must be 1 to {MAX_REQUEST_ID_LENGTH} printable ASCII characters; "
                         f"got {shown}")
    return value


class RequestIdFilter(logging.Filter):
    """Stamps records with the id of the request being served (`%(request_id)s` in a format).

    Install it on a handler (`handler.addFilter(RequestIdFilter())`): a handler's filters see the
    records of every logger that reaches it, where a logger's own see only its own records."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get() or "-"
        return True
