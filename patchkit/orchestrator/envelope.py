"""`CallEnvelope`: one component call as it travels from its batching queue through a backend's channel to a replica.

Made by the front-end's queue when the pipeline code makes the call (or by the profiler for the calls it
times); read by every `Channel.run_batch` (the RPC encodes it for the wire, the inprocess backend runs it
in place). One object per call, so that what a call carries (its deadline, where its chunks go, how it is
cancelled, its trace) cannot fall out of step with its arguments.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from patchkit.core import Call

__all__ = ["CallEnvelope", "when_read"]


@dataclass(eq=False)
class CallEnvelope:
    """A call's arguments and what travels with them.

    `expires`: the event loop's time when its request times out (None: never): a replica does not start
    it later. `on_chunk`: where the text chunks of a `stream=True` method go as they are made (None: its
    outcome only); called on the front-end's loop, it may return a future that is done once the chunk
    has reached its reader (`when_read`), and the method then makes at most a window of chunks
    (`event_loop.STREAM_BUFFER`) ahead of that reader. `ended`: a future cancelled when its request
    ends, which stops the call where it runs (None: it runs to the end). `trace`: its span's context
    (W3C headers, patchkit.telemetry), which the replica's execution span continues (None: not traced).
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    expires: float | None = None
    on_chunk: Callable[[str], object] | None = None
    ended: asyncio.Future[Any] | None = None
    trace: dict[str, str] | None = None

    @property
    def call(self) -> Call:
        return self.args, self.kwargs

    def expires_in(self, now: float) -> float | None:
        """Seconds its request has left at the event loop's time `now`; None: no limit."""
        return None if self.expires is None else self.expires - now


def when_read(handed: object, then: Callable[[], None]) -> None:
    """Call `then` once a chunk handed to an `on_chunk` has been read: `handed` is what that returned, a future
    done when its reader has it, or anything else for a reader that took it at once. Called by the channels
    on the front-end's loop for every chunk, `then` giving its place in the call's window back."""
    if isinstance(handed, asyncio.Future) and not handed.done():
        handed.add_done_callback(lambda _: then())
    else:
        then()
