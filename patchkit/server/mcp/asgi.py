"""One aiohttp request answered by an ASGI application (the MCP SDK's Streamable HTTP handler), streaming included.

The body has been read and decoded by the route (bounded as every body is, `http.read_body`) and is handed to
the application whole; after it, `receive()` waits until the request ends (aiohttp cancels a handler whose
client goes away, which cancels the application). The application's reply is written as it sends it: status
and headers, then each body chunk as it comes (server-sent events), so nothing is buffered here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from aiohttp import web

__all__ = ["ASGIApp", "call_asgi"]

Message = MutableMapping[str, Any]
ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]],
                   Awaitable[None]]
_HOP_BY_HOP = frozenset({"connection", "keep-alive", "transfer-encoding"})  # aiohttp writes its own
_DECODED = frozenset({"content-encoding", "content-length"})  # the body is handed over decoded


async def call_asgi(app: ASGIApp, request: web.Request, body: bytes, headers: dict[str, str]) -> web.StreamResponse:
    """Run `app` on `request` (its `body` as read and decoded); `headers` are added to the request's (an id the
    edge made) and to the reply's. Returns the reply, ended."""
    exchange = _Exchange(request, headers)
    await app(_scope(request, body, headers), _receiver(body), exchange.send)
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


def _receiver(body: bytes) -> Callable[[], Awaitable[Message]]:
    """The body in one message; then a wait for the request's end, answered `http.disconnect`."""
    given = False
    ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await ended  # cancelled with the handler when the client goes away
        return {"type": "http.disconnect"}

    return receive


class _Exchange:
    """The reply, written as the application sends it."""

    def __init__(self, request: web.Request, headers: dict[str, str]) -> None:
        self._request = request
        self._headers = headers
        self._response: web.StreamResponse | None = None
        self._ended = False

    async def send(self, message: Message) -> None:
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
        if not self._ended:
            self._ended = True
            await self._response.write_eof()
        return self._response
