"""One aiohttp request answered by an ASGI application (the MCP SDK's Streamable HTTP handler), streaming included.

The body has been read and decoded by the route (bounded as every body is, `http.read_body`) and is handed to
the application whole; after it, `receive()` waits until the client goes away, and then answers
`http.disconnect`, as an ASGI server does. The application itself is not cancelled with the aiohttp handler
(aiohttp cancels the handler of a client that goes away): it is told of the disconnect and ends its own way (the
MCP SDK cancels the call the request carried, or keeps its session), and what it sends after is dropped. The
reply is written as the application sends it: status and headers, then each body chunk as it comes
(server-sent events), so nothing is buffered here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from aiohttp import web

__all__ = ["ASGIApp", "call_asgi"]

logger = logging.getLogger(__name__)

Message = MutableMapping[str, Any]
ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding"})  # aiohttp writes its own
_DECODED = frozenset({"content-encoding", "content-length"})  # the body is handed over decoded


async def call_asgi(app: ASGIApp, request: web.Request, body: bytes, headers: dict[str, str]) -> web.StreamResponse:
    """Run `app` on `request` (its `body` as read and decoded); `headers` are added to the request's (an id the
    edge made) and to the reply's. Returns the reply, ended."""
    exchange = _Exchange(request, headers)
    running = asyncio.ensure_future(app(_scope(request, body, headers), exchange.receive(body), exchange.send))
    try:
        await asyncio.shield(running)
    except Exception:
        if not exchange.started:
            raise  # the route answers it, as any route's error
        logger.exception("the MCP handler failed after its reply began; the reply ends here")
    except asyncio.CancelledError:
        exchange.disconnect()  # the client went away: the application hears of it, and ends
        try:
            await running
        except asyncio.CancelledError:  # cancelled again (the server stopping): stop it
            running.cancel()
            raise
        except Exception:  # nobody is there to answer
            logger.debug("the MCP handler failed after its client went away", exc_info=True)
        raise
    return await exchange.finish()


def _scope(request: web.Request, body: bytes, headers: dict[str, str]) -> dict[str, Any]:
    given = [(name.lower(), value) for name, value in request.headers.items() if name.lower() not in _DECODED]
    extra = {name.lower(): value for name, value in headers.items()}
    pairs = [(n, v) for n, v in given if n not in extra] + list(extra.items()) + [("content-length", str(len(body)))]
    peer = request.transport.get_extra_info("peername") if request.transport is not None else None
    host = request.transport.get_extra_info("sockname") if request.transport is not None else None
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": f"{request.version.major}.{request.version.minor}",
        "method": request.method,
        "scheme": request.scheme,
        "path": request.path,
        "raw_path": request.raw_path.split("?", 1)[0].encode(),
        "query_string": request.query_string.encode(),
        "root_path": "",
        "headers": [(name.encode("latin-1"), value.encode("latin-1")) for name, value in pairs],
        "client": tuple(peer[:2]) if isinstance(peer, tuple) else None,
        "server": tuple(host[:2]) if isinstance(host, tuple) else None,
    }


class _Exchange:
    """The reply, written as the application sends it."""

    def __init__(self, request: web.Request, headers: dict[str, str]) -> None:
        self._request = request
        self._headers = headers
        self._response: web.StreamResponse | None = None
        self._ended = False
        self._gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def started(self) -> bool:
        """Whether the reply's status and headers have gone out."""
        return self._response is not None

    def receive(self, body: bytes) -> Callable[[], Awaitable[Message]]:
        """The body in one message; then a wait for the client to go away, answered `http.disconnect`."""
        given = False

        async def receive() -> Message:
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.shield(self._gone)
            return {"type": "http.disconnect"}

        return receive

    def disconnect(self) -> None:
        """The client went away: `receive` answers `http.disconnect`, and what is sent from now on is dropped."""
        if not self._gone.done():
            self._gone.set_result(None)

    async def send(self, message: Message) -> None:
        if self._gone.done():
            return
        try:
            await self._write(message)
        except ConnectionError:  # the client went away while it was written
            self.disconnect()

    async def _write(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            response = web.StreamResponse(status=message["status"])
            for name, value in message.get("headers", ()):
                key = name.decode("latin-1")
                if key.lower() not in _HOP_BY_HOP:
                    response.headers.add(key, value.decode("latin-1"))
            response.headers.update(self._headers)
            self._response = response
            await response.prepare(self._request)  # the status and headers go out now: a stream starts with them
        elif message["type"] == "http.response.body" and self._response is not None and not self._ended:
            if message.get("body"):
                await self._response.write(message["body"])
            if not message.get("more_body", False):
                self._ended = True
                await self._response.write_eof()

    async def finish(self) -> web.StreamResponse:
        if self._response is None:
            raise RuntimeError("the MCP handler sent no reply")
        if not self._ended and not self._gone.done():
            self._ended = True
            await self._response.write_eof()
        return self._response
