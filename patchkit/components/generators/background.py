"""`BackgroundLoop`: an asyncio event loop in a daemon thread of its own, for generators whose client
is asynchronous (vLLM's engine, aiohttp) but whose `generate` runs in the worker's threads, one per
call, and may run where a loop already runs (the inprocess backend's front-end, a Jupyter kernel)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any, TypeVar

from patchkit.component.event_loop import CLOSE_TIMEOUT_S, iterate_on

__all__ = ["BackgroundLoop"]

T = TypeVar("T")


class BackgroundLoop:
    """One event loop running in a daemon thread, started at construction; any thread hands it work."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and self.loop.is_running()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coroutine` on the loop and wait for its result (or its exception), from any other thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def iterate(self, items: AsyncIterator[T]) -> Iterator[T]:
        """The items of the async iterator `items`, which runs on the loop, as a plain iterator
        (`event_loop.iterate_on`: closing it early cancels the task that runs `items`, so its `finally`
        and `async with` blocks run, an engine request aborted)."""
        return iterate_on(lambda coroutine: asyncio.run_coroutine_threadsafe(coroutine, self.loop), items)

    def close(self, last: Callable[[], Coroutine[Any, Any, Any]] | None = None) -> None:
        """Run `last()` on the loop (closing what lives on it, such as an HTTP session), then stop the loop
        and its thread; called when the generator that owns it is collected. From the loop's own thread
        (a collection that happens there) it only stops the loop: waiting on itself would never end."""
        if threading.current_thread() is self._thread:
            self.loop.stop()
            return
        if last is not None and self.alive():
            with contextlib.suppress(Exception):
                self.run(last(), CLOSE_TIMEOUT_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self.loop.close()
