"""Reading a streamed query (`POST /v1/query` with `"stream": true`) on the client: `Stream` and `AsyncStream`.

Iterating one yields the output's text as it is produced; once done, `output` and `request_id`
hold the final reply. When the output is a string, the chunks always add up to it: what the
server's deltas did not carry (all of it, when the output came from no streaming call) comes as
a last chunk.

Opened with `steps=True`, the stream yields a `Step` as each component call of the request starts
and as it ends, among the text chunks in the order they happened (`patchkit.serving.steps` says
what each carries); `steps` keeps them all.

The events are read by their names: unnamed ones carry a text delta or the final reply, `event: step` a
step, `event: error` the error the request failed with after the stream began (raised), and `event: end`,
always last, ends the stream.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import httpx

from patchkit.errors import PatchkitError, error_from_json

__all__ = ["AsyncStream", "ServerEvent", "Step", "Stream", "sse_data", "sse_events"]

MESSAGE = "message"  # the name of an unnamed event, as the SSE standard calls it

if TYPE_CHECKING:  # what a stream yields: text (a bare `Stream`), or text and steps
    import typing_extensions

    Chunk = typing_extensions.TypeVar("Chunk", default=str)
else:
    Chunk = TypeVar("Chunk")


@dataclass(frozen=True)
class Step:
    """One step event: a component call of the request started (`phase` "start") or ended ("end").

    An end carries the batch it rode in, the replica that ran it, its wait in the queue and its duration
    (milliseconds), and its `error` (`{"type", "message"}`) where it failed. Where the deployment offers
    previews (its `steps` option is "previews"), an end also carries a `preview` of its result: a JSON value
    cut by structure (`preview_truncated` says whether it was), None for a component marked `sensitive` (then
    `sensitive` is True). `at_ms`: since the request arrived.
    """

    phase: str
    call: int
    component: str
    method: str
    node: str | None = None
    at_ms: float = 0.0
    batch: int | None = None
    replica: str | None = None
    wait_ms: float | None = None
    duration_ms: float | None = None
    preview: Any = None
    preview_truncated: bool = False
    error: dict[str, str] | None = None
    sensitive: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # fields a newer endpoint sends

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Step:
        """The step a `data: {"step": {...}}` event carries."""
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in data.items() if k in known},
                   extra={k: v for k, v in data.items() if k not in known})


@dataclass(frozen=True)
class ServerEvent:
    """One server-sent event: its name (`event:`, "message" where it has none) and its data."""

    event: str
    data: str


class _Events:
    """Server-sent events from lines: `feed` returns an event at the blank line that ends it."""

    def __init__(self) -> None:
        self._data: list[str] = []
        self._name = MESSAGE

    def feed(self, line: str) -> ServerEvent | None:
        field, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if not line:
            return self.flush()
        if field == "data":
            self._data.append(value)
        elif field == "event":
            self._name = value or MESSAGE
        return None  # a comment (":..."), an id, a retry, or a field no reader knows

    def flush(self) -> ServerEvent | None:
        """The event still open when the stream ends, if any (an event with no data is none, as in browsers)."""
        data, name, self._data, self._name = self._data, self._name, [], MESSAGE
        return ServerEvent(name, "\n".join(data)) if data else None


def sse_events(lines: Iterator[str]) -> Iterator[ServerEvent]:
    """Each server-sent event in `lines`, its name and its data (multi-line data joined by newlines).

    Each as soon as the line that ends it is read: `Stream` hands on chunks while the output is made.
    """
    events = _Events()
    for line in itertools.chain(lines, [""]):
        if (event := events.feed(line)) is not None:
            yield event


def sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The `data` of each server-sent event in `lines`, whatever its name (`sse_events` gives both)."""
    return (event.data for event in sse_events(lines))


class _Reader:
    """Turns events into text chunks (and steps) and keeps the final reply; shared by both streams."""

    def __init__(self) -> None:
        self.output: Any = None
        self.request_id: str | None = None
        self.done = False
        self.ended = False  # the `end` event came: the stream has nothing more
        self.steps: list[Step] = []
        self._streamed: list[str] = []

    def read(self, message: ServerEvent) -> Any:
        """The chunk or `Step` an event carries, if any; raises the error an error event carries."""
        event = json.loads(message.data)
        if message.event == "end":
            self.ended = True
            return None
        if message.event == "step" or "step" in event:
            step = Step.from_json(event["step"])
            self.steps.append(step)
            return step
        if message.event == "error" or "error" in event:
            raise error_from_json(event["error"])
        if "delta" in event:
            self._streamed.append(event["delta"])
            return str(event["delta"])
        self.output, self.request_id, self.done = event.get("output"), event.get("request_id"), True
        streamed = "".join(self._streamed)
        if isinstance(self.output, str) and self.output.startswith(streamed) and len(self.output) > len(streamed):
            return self.output[len(streamed):]
        return None

    def check(self, response: httpx.Response, reply: Callable[[httpx.Response], Any]) -> bool:
        """Whether the reply is an event stream.

        Else the endpoint answered JSON: raise its error, or take its reply as the final event.
        """
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return True
        data = reply(response)
        self.output, self.request_id, self.done = data.get("output"), data.get("request_id"), True
        return False

    def finished(self) -> None:
        if not self.done:
            raise PatchkitError("the endpoint's event stream ended before its final event")


class Stream(_Reader, Generic[Chunk]):
    """What `Endpoint.stream()` returns: iterate it for the output's text chunks, then read `output`.

        stream = endpoint.stream(question="What is a generator?")
        for chunk in stream:  # each chunk as the output's streaming call yields it
            print(chunk, end="")
        print(stream.output, stream.request_id)  # the whole output, as query() returns it

    With `steps=True` the iteration also yields a `Step` as each component call starts and ends, in the order
    they happened (`stream.steps` keeps them all). The request is sent when the iteration starts, and each
    iteration sends it again. A pipeline whose output no streaming call makes answers in one piece: the
    iteration yields its output once if it is a string. An error the pipeline raises after the stream started
    is raised by the iteration, as `query()` raises it.

    Attributes:
        output: the pipeline's output once the iteration ended (None before).
        request_id: the request's id (its `X-Request-ID`) once the iteration ended (None before).
    """

    def __init__(self, open_response: Callable[[], Any], reply: Callable[[httpx.Response], Any]) -> None:
        super().__init__()
        self._open, self._reply = open_response, reply

    def __iter__(self) -> Iterator[Chunk]:
        with self._open() as response:
            if not self.check(response, lambda r: self._reply(_read(r))):
                if isinstance(self.output, str):
                    yield self.output  # type: ignore[misc]  # text is a chunk of every stream
                return
            for event in sse_events(response.iter_lines()):
                chunk = self.read(event)
                if chunk:
                    yield chunk
                if self.ended:
                    break
        self.finished()


class AsyncStream(_Reader, Generic[Chunk]):
    """What `Endpoint.astream()` returns: `async for` it for text chunks (and `Step`s), then read `output`.

    As `Stream`, with `output` and `request_id` set once the iteration ended.

    Leaving the loop early closes the stream once the loop's generator is collected; to close it at a point
    of your choosing (the endpoint then cancels the request), use it as a context manager, or `aclose()` it:

        async with endpoint.astream(query="...") as stream:
            async for chunk in stream:
                break
    """

    def __init__(self, open_response: Callable[[], Any], reply: Callable[[httpx.Response], Any]) -> None:
        super().__init__()
        self._open, self._reply = open_response, reply
        self._iterations: list[AsyncGenerator[Chunk, None]] = []

    def __aiter__(self) -> AsyncIterator[Chunk]:
        iteration = self._chunks()
        self._iterations.append(iteration)
        return iteration

    async def aclose(self) -> None:
        """Close the stream where an iteration left it open: its connection closes, and the endpoint cancels its request."""
        iterations, self._iterations = self._iterations, []
        for iteration in iterations:
            await iteration.aclose()

    async def __aenter__(self) -> AsyncStream[Chunk]:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _chunks(self) -> AsyncGenerator[Chunk, None]:
        async with self._open() as response:
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                await response.aread()
            if not self.check(response, self._reply):
                if isinstance(self.output, str):
                    yield self.output  # type: ignore[misc]  # text is a chunk of every stream
                return
            events = _Events()
            async for line in response.aiter_lines():
                event = events.feed(line)
                chunk = self.read(event) if event is not None else None
                if chunk:
                    yield chunk
                if self.ended:
                    break
            event = None if self.ended else events.flush()
            chunk = self.read(event) if event is not None else None
            if chunk:
                yield chunk
        self.finished()


def _read(response: httpx.Response) -> httpx.Response:
    response.read()
    return response
