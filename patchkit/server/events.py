"""Server-sent events: a reply streamed as `data: ...` events while the pipeline produces text.

A route runs its request through `pump`, which hands each text chunk the front-end reports
(`RequestRunner.query(on_delta=...)`) to the route as it comes, then returns the request's result. The
`EventStream` starts the reply (200, `text/event-stream`) with its first event only, so that a
request that fails before producing anything still gets its plain JSON error and status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from aiohttp import web

__all__ = ["EventStream", "pump"]

T = TypeVar("T")


class EventStream:
    """One `text/event-stream` reply, prepared when its first event is sent."""

    def __init__(self, request: web.Request, headers: dict[str, str]) -> None:
        self._request = request
        self._headers = headers
        self.response: web.StreamResponse | None = None

    @property
    def started(self) -> bool:
        """Whether the reply's status and headers have gone out (an error can then only be an event)."""
        return self.response is not None

    async def send(self, data: bytes) -> None:
        """One event; raises ConnectionResetError when the client has gone away."""
        if self.response is None:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **self._headers}
            self.response = web.StreamResponse(headers=headers)
            self.response.content_type = "text/event-stream"
            self.response.charset = "utf-8"
            await self.response.prepare(self._request)
        await self.response.write(b"data: " + data + b"\n\n")

    async def finish(self) -> web.StreamResponse:
        """End the stream; called once, after at least one `send`."""
        assert self.response is not None, "an event stream ends after its first event"
        await self.response.write_eof()
        return self.response


async def pump(run: Callable[[Callable[[str], None]], Awaitable[T]], on_delta: Callable[[str], Awaitable[None]]) -> T:
    """Run `run(report)`, awaiting `on_delta(chunk)` for each chunk it reports, in order; return its
    result once every chunk reported before it ended has been handed on.

    `report` is called on the event loop, synchronously (the front-end's `on_delta`); it only queues
    the chunk. Should `on_delta` raise (the client went away), the request is cancelled.
    """
    chunks: asyncio.Queue[str] = asyncio.Queue()
    task = asyncio.ensure_future(run(chunks.put_nowait))
    try:
        while not task.done():
            getter = asyncio.ensure_future(chunks.get())
            await asyncio.wait((task, getter), return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                await on_delta(getter.result())
            else:
                getter.cancel()
        while not chunks.empty():
            await on_delta(chunks.get_nowait())
    except BaseException:
        task.cancel()
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # its error is no longer anyone's
        raise
    return task.result()
