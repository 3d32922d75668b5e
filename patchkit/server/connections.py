"""The connections under the HTTP API: malformed HTTP answered as JSON, client faults logged as warnings.

aiohttp reads the requests; `EdgeRunner` gives every connection the `EdgeConnection` handler,
which differs from aiohttp's own in what a client's mistake costs the operator:

- a request aiohttp cannot parse (a header without a colon, a Content-Length that is not a
  number, a broken chunk) is answered 400 with the API's JSON error and logged as one WARNING
  line, not as an ERROR with a traceback and a plain-text reply;
- a body that breaks off after its route answered (the route logged its WARNING already) is a
  DEBUG line.

The read timeouts are set where the runner is made (`server/process.py`): aiohttp closes a
connection that sends no complete request headers for its keep-alive timeout, and the query route
bounds the body's read (`server/http.py`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError
from aiohttp.web_request import BaseRequest

__all__ = ["EdgeConnection", "EdgeRunner"]

logger = logging.getLogger("patchkit.server.http")


class EdgeConnection(RequestHandler):
    """One client connection; made by `EdgeRunner`'s server for every connection it accepts."""

    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """Called by aiohttp for a request it could not parse (4xx), or a route that raised (500)."""
        if status >= 500:
            logger.error("handling a request from %s failed", request.remote, exc_info=exc)  # our bug: its traceback
            kind, text = "InternalServerError", "the server failed to handle the request"
        else:
            kind, text = "BadRequest", " ".join(str(message or exc or "malformed HTTP request").split())[:300]
            logger.warning("malformed HTTP request from %s: %d %s", request.remote, status, text)
        if request.writer.output_size > 0:  # a reply has begun: the connection can only be dropped
            raise ConnectionError("the reply had begun; the connection is dropped")
        body = json.dumps({"error": {"type": kind, "message": text}}).encode()
        response = web.Response(status=status, body=body, content_type="application/json")
        response.force_close()
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        """A body the client broke off (after its route answered) is the client's doing: DEBUG, not ERROR."""
        error = kw.get("exc_info")
        if isinstance(error, (RequestPayloadError, ConnectionError)):
            kw["exc_info"] = False
            self.logger.debug(*args, **kw)
            return
        super().log_exception(*args, **kw)


class _EdgeServer(web.Server):
    def __call__(self) -> RequestHandler:
        return EdgeConnection(self, loop=self._loop, **self._kwargs)


class EdgeRunner(web.AppRunner):
    """An `AppRunner` whose connections are `EdgeConnection`s; takes AppRunner's arguments."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        return _EdgeServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            **server._kwargs,
        )
