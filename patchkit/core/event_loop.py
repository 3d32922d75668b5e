"""The event loop `async def` components run on: one per process, in a daemon thread of its own.

Every coroutine of a component (an `async def` `@make` method, an async generator with `stream=True`,
an `async def setup()`) runs on this loop, whoever calls it. Plain code on any other thread hands it
over and waits (`EventLoop.run`, `EventLoop.iterate`): the eager call of capture's run, of
`pipeline(...)`, of a notebook cell whose own loop is running (its thread waits as it waits for any
method, while the call runs on this loop, not on the cell's). A worker and the inprocess backend start
a batch's calls as tasks here (`EventLoop.submit`) and take their outcomes as they end, so a replica
holds as many calls at once as it allows without a thread each. One loop per process keeps what
`setup()` makes on it (an HTTP client's connections, a semaphore) on the loop every call runs on.

`watched` times each step of a call (its code between two awaits), as asyncio's debug mode times
callbacks: a step that holds the loop past PATCHKIT_SLOW_STEP_S is logged as a warning naming the
method, since a blocking call inside an `async def` (time.sleep, a synchronous client) stalls every
other call on the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import logging
import os
import queue
import threading
import time
import types
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterator
from typing import Any, TypeVar

from patchkit import envs
from patchkit.errors import MakeError

__all__ = [
    "CLOSE_TIMEOUT_S", "STREAM_BUFFER", "ChunkWindow", "EventLoop", "component_loop", "iterate_inline", "iterate_on",
    "on_component_loop", "run_inline", "watched",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
CLOSE_TIMEOUT_S = 5.0  # how long closing a stream early waits for its coroutine to finish its cleanup
STREAM_BUFFER = 16  # chunks a generator may make ahead of whoever reads them before it waits (ChunkWindow)
WINDOW_POLL_S = 0.1  # how often a thread waiting for its reader checks whether its call is being stopped
_END = object()


class EventLoop:
    """An asyncio loop running forever in a daemon thread, started at construction; other threads hand it coroutines."""

    def __init__(self, name: str = "patchkit-components") -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._incoming: list[tuple[Coroutine[Any, Any, Any], contextvars.Context]] = []
        self._incoming_lock = threading.Lock()
        self.thread.start()

    def on_loop(self) -> bool:
        """Whether the calling code runs on this loop (inside one of its coroutines)."""
        return threading.current_thread() is self.thread

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start `coroutine` as a task on the loop, in a copy of the caller's context (its call hook goes
        with it); cancelling the returned future cancels the task. Called from any thread."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def start(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        """Start `coroutine` as a task on the loop, in a copy of the caller's context, without waiting for it
        or keeping a future of it (it reports its own outcome); called from any thread. Cheaper than
        `submit` for a worker's many calls."""
        with self._incoming_lock:
            self._incoming.append((coroutine, contextvars.copy_context()))
            if len(self._incoming) > 1:
                return  # a wake-up is on its way already: it starts this one too
        self.loop.call_soon_threadsafe(self._start_incoming)

    def _start_incoming(self) -> None:
        """Start what `start` handed over since the last wake-up: under load, many coroutines per wake-up."""
        with self._incoming_lock:
            incoming, self._incoming = self._incoming, []
        for coroutine, context in incoming:
            task = self.loop.create_task(coroutine, context=context)
            self._tasks.add(task)  # held until it ends: the loop keeps only weak references to its tasks
            task.add_done_callback(self._tasks.discard)

    def run(self, coroutine: Coroutine[Any, Any, T], what: str) -> T:
        """Run `coroutine` on the loop and wait for its result (or raise its exception) in the calling
        thread, which must not be the loop's: `what` names the call in the error raised there. A caller
        interrupted while it waits (Ctrl-C) cancels the coroutine."""
        self._refuse_own_thread(what)
        future = self.submit(coroutine)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def iterate(self, items: AsyncGenerator[T, None], what: str) -> Iterator[T]:
        """The items of the async generator `items`, which starts on the loop now, as a plain iterator for
        another thread (`iterate_on`)."""
        self._refuse_own_thread(what)
        return iterate_on(self.submit, items)

    def _refuse_own_thread(self, what: str) -> None:
        if self.on_loop():
            raise MakeError(
                f"{what} is async def and was called without await from code running on patchkit's event loop "
                "(inside an async component method), where waiting for it would hold the loop forever; "
                "call it from a plain def method, or make the caller a plain def"
            )


def iterate_on(
    submit: Callable[[Coroutine[Any, Any, None]], concurrent.futures.Future[None]],
    items: AsyncIterator[T],
    buffer: int = STREAM_BUFFER,
) -> Iterator[T]:
    """The items of the async iterator `items`, run by a coroutine that `submit` starts on a loop in another
    thread, as a plain iterator for the calling thread. Used by `EventLoop` and by the generators' own loops
    (`components/generators/background.py`).

    At most `buffer` items wait between the two: once that many are made and not yet taken, `items` waits
    where it yields until the consumer takes one (a slow consumer slows the generator, never grows a queue).
    However `items` ends, the iterator ends: at its last item, or raising its error, a `CancelledError` or
    `GeneratorExit` raised inside it included (its own, not the loop cancelling it). Closing the iterator
    early (the consumer stops) cancels that coroutine, so the `finally` and `async with` blocks of `items` run
    (an HTTP response is closed, an engine request aborted), and waits for that up to CLOSE_TIMEOUT_S.
    """
    received: queue.SimpleQueue[Any] = queue.SimpleQueue()
    done = threading.Event()
    window = ChunkWindow(buffer)

    async def pump() -> None:
        try:
            closing = contextlib.aclosing(items) if isinstance(items, AsyncGenerator) else contextlib.nullcontext()
            async with closing:
                async for item in items:
                    await window.take_async()
                    received.put(item)
            received.put(_END)
        except (Exception, asyncio.CancelledError, GeneratorExit) as exc:
            if isinstance(exc, asyncio.CancelledError) and _cancelled_from_outside():
                raise  # the consumer closed the iterator: nobody waits for an outcome
            received.put(_Failure(exc))  # handed to the consumer, which raises it in its own thread
        finally:
            done.set()

    future = submit(pump())
    try:
        while (item := received.get()) is not _END:
            if isinstance(item, _Failure):
                raise item.error
            window.give()
            yield item
    finally:
        if not done.is_set():
            future.cancel()
            done.wait(CLOSE_TIMEOUT_S)


def _cancelled_from_outside() -> bool:
    """Whether the running task is being cancelled (by `Task.cancel`), as opposed to its code raising
    CancelledError itself (a future cancelled elsewhere that it awaited, or a bare `raise`)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class ChunkWindow:
    """A bounded buffer's bookkeeping between a producer of chunks and their reader, on any threads.

    The producer may be `size` chunks ahead of its reader: each chunk it hands over takes one place
    (`take`, from a thread; `take_async`, from a coroutine), and waits while none is left; each chunk the
    reader has taken gives one back (`give`, from any thread). Used by `iterate_on` and by a replica for
    every streaming call whose chunks a client reads (orchestrator/execute.py), so that a slow reader slows
    its generator instead of growing a queue.
    """

    def __init__(self, size: int = STREAM_BUFFER) -> None:
        if size < 1:
            raise ValueError(f"a window holds at least one chunk; got {size}")
        self.size = size
        self._left = size
        self._changed = threading.Condition()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    def take(self, stop: threading.Event) -> None:
        """Take a place for a chunk, waiting while there is none, or until `stop` is set (checked every
        WINDOW_POLL_S: the call is being stopped, so it goes on to its next chunk, where it stops)."""
        with self._changed:
            self._left -= 1
            while self._left < 0 and not stop.is_set():
                self._changed.wait(WINDOW_POLL_S)

    async def take_async(self) -> None:
        """`take` for a coroutine on an event loop: it waits there, and a cancellation ends the wait."""
        with self._changed:
            self._left -= 1
            if self._left >= 0:
                return
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()
            self._waiter = (loop, waiter)
        try:
            await waiter
        finally:
            with self._changed:
                if self._waiter is not None and self._waiter[1] is waiter:
                    self._waiter = None

    def give(self, count: int = 1) -> None:
        """The reader has taken `count` chunks: their places are free again."""
        with self._changed:
            self._left += count
            self._changed.notify_all()
            waiter = self._waiter if self._left >= 0 else None
            if waiter is not None:
                self._waiter = None
        if waiter is not None:
            loop, future = waiter
            loop.call_soon_threadsafe(_wake, future)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def watched(awaitable: Awaitable[T], name: str) -> Awaitable[T]:
    """`awaitable` with each of its steps timed: a step that holds the loop PATCHKIT_SLOW_STEP_S or longer is
    logged as a warning naming `name` (the method) and how long it held it. Awaited by `MakeMethod` for
    every coroutine of a component."""
    return _stepped(awaitable.__await__(), name, envs.slow_step_s())


@types.coroutine
def _stepped(steps: Generator[Any, Any, T], name: str, limit_s: float) -> Generator[Any, Any, T]:
    """Drive `steps` as `yield from` would, timing each send into it (each runs user code until its next await)."""
    value: Any = None
    error: BaseException | None = None
    while True:
        started = time.perf_counter()
        try:
            yielded = steps.send(value) if error is None else steps.throw(error)
        except StopIteration as stop:
            _check(name, started, limit_s)
            return stop.value
        except BaseException:
            _check(name, started, limit_s)
            raise
        _check(name, started, limit_s)
        try:
            value, error = (yield yielded), None
        except GeneratorExit:
            steps.close()
            raise
        except BaseException as exc:  # a cancellation (or anything thrown in) goes on to the awaited code
            value, error = None, exc


def _check(name: str, started: float, limit_s: float) -> None:
    held = time.perf_counter() - started
    if held >= limit_s:
        logger.warning(
            "%s held the event loop for %.3f s between two awaits (PATCHKIT_SLOW_STEP_S is %g s): every other call "
            "on the loop waited; a blocking call (time.sleep, a synchronous client) belongs in "
            "`await asyncio.to_thread(...)`, or the method in a plain def",
            name, held, limit_s,
        )


def run_inline(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine`, which never waits (it awaits only coroutines that return without suspending), to its end in
    the calling thread, on no loop. How a plain `def` method's calls run through the one asynchronous core that
    `MakeMethod` writes for both kinds of method.

    Raises:
        RuntimeError: the coroutine waited after all (it was closed first).
    """
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise RuntimeError(f"{coroutine!r} waited, and runs only on an event loop")


def iterate_inline(items: AsyncGenerator[T, None]) -> Iterator[T]:
    """The items of the async generator `items`, which never waits, as a plain iterator for the calling thread
    (`run_inline` for each step). Closing the iterator closes `items`."""
    try:
        while True:
            try:
                item = run_inline(items.__anext__())
            except StopAsyncIteration:
                return
            yield item
    finally:
        run_inline(items.aclose())


_LOOP: EventLoop | None = None
_LOOP_LOCK = threading.Lock()


def component_loop() -> EventLoop:
    """This process's loop for the coroutines of components, started at its first use."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None or not _LOOP.thread.is_alive():
            _LOOP = EventLoop()
        return _LOOP


def on_component_loop() -> bool:
    """Whether the calling code runs on this process's loop for components (inside one of their coroutines)."""
    return _LOOP is not None and _LOOP.on_loop()


def _forget_after_fork() -> None:
    global _LOOP
    _LOOP = None  # its thread does not exist in the child: the child starts its own at its first use


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)

