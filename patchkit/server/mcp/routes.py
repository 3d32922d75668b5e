"""`/mcp`: the MCP server over Streamable HTTP, through the SDK's `StreamableHTTPSessionManager`.

Registered by `build_app` (server/http.py) behind the same edge as every route: request ids, the bearer token,
503 while the workers start. The SDK is imported, and its session manager started, at the first request to
`/mcp`, so a deployment that no agent talks to loads none of it; where the `mcp` package is not installed that
request is answered 501, saying what to install. The manager stops with the app.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from patchkit.server.inputs import InputSchema
from patchkit.server.mcp.asgi import ASGIApp, call_asgi
from patchkit.server.replies import REQUEST_ID_HEADER, json_reply, request_id_of
from patchkit.serving.frontend import Frontend, Version

if TYPE_CHECKING:
    from patchkit.server.mcp.tools import PipelineTools

__all__ = ["INSTALL", "PATH", "McpRoutes"]

logger = logging.getLogger(__name__)

PATH = "/mcp"
INSTALL = "pip install -e '.[mcp]' in patchkit's checkout"
ReadBody = Callable[[web.Request, Callable[[bytes], Awaitable[web.StreamResponse]]], Awaitable[web.StreamResponse]]


class McpRoutes:
    """`GET`, `POST` and `DELETE /mcp` over `frontend`; `read_body` reads each body as the query routes do, and
    `schema` gives a version's inputs (the app's cached `schema_of`)."""

    def __init__(self, frontend: Frontend, read_body: ReadBody, schema: Callable[[Version], InputSchema]) -> None:
        self.frontend = frontend
        self._read_body = read_body
        self._schema = schema
        self._starting: asyncio.Task[_Running] | None = None
        self._running: _Running | None = None

    def add_to(self, app: web.Application) -> None:
        """Put the routes on `app`, and stop the session manager when it is cleaned up."""
        for method in ("GET", "POST", "DELETE"):
            app.router.add_route(method, PATH, self.handle)
        app.cleanup_ctx.append(self._lifetime)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """One Streamable HTTP request: a JSON-RPC message posted (answered as JSON or as server-sent events), the
        GET stream of a session's notifications, or a DELETE ending a session."""
        try:
            running = await self._start()
        except ModuleNotFoundError as exc:
            message = f"MCP needs the mcp package, which is not installed ({exc}): {INSTALL}"
            return json_reply(501, {"error": {"type": "NotImplemented", "message": message},
                                    "request_id": request_id_of(request)})
        headers = {REQUEST_ID_HEADER: request_id_of(request)}
        return await self._read_body(request, lambda body: call_asgi(running.app, request, body, headers))

    async def _start(self) -> _Running:
        if self._running is None:
            if self._starting is None:
                self._starting = asyncio.ensure_future(_Running.start(self.frontend, self._schema))
            try:
                self._running = await asyncio.shield(self._starting)
            except ModuleNotFoundError:
                self._starting = None
                raise
        return self._running

    async def _lifetime(self, app: web.Application) -> AsyncIterator[None]:
        yield
        if self._starting is not None and not self._starting.cancelled() and self._starting.done():
            if self._starting.exception() is None:
                await self._starting.result().stop()


class _Running:
    """The SDK's session manager, run by a task of its own (its task group lives as long as the manager)."""

    def __init__(self, tools: PipelineTools, app: ASGIApp, task: asyncio.Task[None], stop: asyncio.Event) -> None:
        self.tools = tools
        self.app = app
        self._task = task
        self._stop = stop

    @classmethod
    async def start(cls, frontend: Frontend, schema: Callable[[Version], InputSchema]) -> _Running:
        from mcp.server.streamable_http_manager import StreamableHTTPSessionManager

        from patchkit.server.mcp.tools import PipelineTools

        tools = PipelineTools(frontend, schema)
        # Sessions (a handshake-era client's GET stream carries its notifications); SSE replies (progress).
        manager = StreamableHTTPSessionManager(tools.server, max_request_body_size=frontend.config.limits.max_body_bytes)
        started, stop = asyncio.Event(), asyncio.Event()

        async def run() -> None:
            async with manager.run():
                started.set()
                await stop.wait()

        task = asyncio.get_running_loop().create_task(run(), name="patchkit-mcp")
        ready = asyncio.ensure_future(started.wait())
        await asyncio.wait((task, ready), return_when=asyncio.FIRST_COMPLETED)
        if not started.is_set():
            ready.cancel()
            await task  # raises why it did not start
        tools.start()
        logger.info("serving MCP at %s: a tool per pipeline", PATH)
        return cls(tools, manager.handle_request, task, stop)

    async def stop(self) -> None:
        """End the listen streams and sessions, and the manager's task."""
        self.tools.stop()
        self._stop.set()
        await self._task
