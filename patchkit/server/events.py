"""Server-sent events: a reply streamed as `data: ...` events (some named, `event: step`) while the pipeline
produces text.

A route runs its request through `pump`, which hands each text chunk the front-end reports
(`RequestRunner.query(on_delta=...)`), and each step event where the client asked for them
(`on_step=...`), to the route as it comes, in the order reported, then returns the request's result. The
`EventStream` starts the reply (200, `text/event-stream`) with its first event only, so that a
request that fails before producing anything still gets its plain JSON error and status.

A query stream's events carry the shapes below (`STREAM_EVENTS`), which `GET /openapi.json` publishes by name.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Literal, NotRequired, TypeVar

from aiohttp import web
from typing_extensions import TypedDict

from patchkit.server.reports import ErrorBody, QueryReply
from patchkit.serving.steps import StepEvent

__all__ = ["END_EVENT", "ERROR_EVENT", "STEP_EVENT", "STREAM_EVENTS", "EventStream", "StreamDelta", "StreamEnd",
           "StreamError", "StreamStep", "pump"]

# The names of a query stream's named events; its deltas and its final reply are unnamed.
STEP_EVENT = "step"  # `data: {"step": StepEvent}`, where the client asked for steps
ERROR_EVENT = "error"  # `data: {"error": {"type", "message"}, "request_id"}`: the request failed after the stream began
END_EVENT = "end"  # `data: {"request_id", "status": "ok" | "error"}`: always last


class StreamDelta(TypedDict):
    """An unnamed event: a text chunk of the output's streaming call."""

    delta: str
    field: NotRequired[str]
    """Of a dict output whose several fields stream: the field the chunk is of."""


class StreamStep(TypedDict):
    """`event: step`: a component call started or ended (only where the client asked for steps)."""

    step: StepEvent


class StreamError(TypedDict):
    """`event: error`: the request failed after the stream began; an `event: end` follows."""

    error: ErrorBody
    request_id: str


class StreamEnd(TypedDict):
    """`event: end`: always the stream's last event."""

    request_id: str
    status: Literal["ok", "error"]


STREAM_EVENTS = (StreamDelta, StreamStep, QueryReply, StreamError, StreamEnd)  # the data of a query stream's events
STREAM_DESCRIPTION = (
    "With stream: true, server-sent events: unnamed events (`data:` only) carry a StreamDelta per text chunk, then "
    "the final QueryReply; `event: step` carries a StreamStep as each component call starts and ends (where the client "
    "asked for steps and the deployment offers them); `event: error` carries a StreamError where the request failed "
    "after the stream began, instead of the QueryReply; `event: end` carries a StreamEnd, always last.")


T = TypeVar("T")
Item = TypeVar("Item")


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

    async def send(self, data: bytes, event: str | None = None) -> None:
        """One event, named `event` (None: unnamed, a "message" to an SSE reader); raises ConnectionResetError when
        the client has gone away."""
        if self.response is None:
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **self._headers}
            self.response = web.StreamResponse(headers=headers)
            self.response.content_type = "text/event-stream"
            self.response.charset = "utf-8"
            await self.response.prepare(self._request)
        named = b"" if event is None else b"event: " + event.encode() + b"\n"
        await self.response.write(named + b"data: " + data + b"\n\n")

    async def end(self, request_id: str, *, ok: bool) -> web.StreamResponse:
        """A query stream's last event, `event: end` with the request's id and status, and the end of the stream."""
        await self.send(json.dumps({"request_id": request_id, "status": "ok" if ok else "error"}).encode(), END_EVENT)
        return await self.finish()

    async def finish(self) -> web.StreamResponse:
        """End the stream; called once, after at least one `send`."""
        assert self.response is not None, "an event stream ends after its first event"
        await self.response.write_eof()
        return self.response


async def pump(run: Callable[[Callable[[Item], object]], Awaitable[T]], on_delta: Callable[[Item], Awaitable[None]]) -> T:
    """Run `run(report)`, awaiting `on_delta(chunk)` for each chunk (or step event) it reports, in order; return
    its result once every chunk reported before it ended has been handed on.

    `report` is called on the event loop, synchronously (the front-end's `on_delta`); it queues the chunk
    and returns a future done once `on_delta` has handed it on (sent to the client): the call making the
    chunks waits for it once it is a window ahead (`CallEnvelope.on_chunk`), so a slow client slows the
    generator instead of growing this queue. Should `on_delta` raise (the client went away), the request is
    cancelled.
    """
    loop = asyncio.get_running_loop()
    chunks: asyncio.Queue[tuple[Item, asyncio.Future[None]]] = asyncio.Queue()

    def report(chunk: Item) -> asyncio.Future[None]:
        handed: asyncio.Future[None] = loop.create_future()
        chunks.put_nowait((chunk, handed))
        return handed

    async def hand_on(chunk: Item, handed: asyncio.Future[None]) -> None:
        await on_delta(chunk)
        if not handed.done():
            handed.set_result(None)

    task = asyncio.ensure_future(run(report))
    getter: asyncio.Future[tuple[Item, asyncio.Future[None]]] | None = None
    try:
        while not task.done():
            getter = asyncio.ensure_future(chunks.get())
            await asyncio.wait((task, getter), return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                await hand_on(*getter.result())
            getter.cancel()
        while not chunks.empty():
            await hand_on(*chunks.get_nowait())
    except BaseException:
        task.cancel()
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # its error is no longer anyone's
        raise
    finally:
        if getter is not None:  # a client that went away leaves no task waiting on the queue
            getter.cancel()
    return task.result()
