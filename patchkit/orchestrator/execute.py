"""Running one batch of calls on a component, with an outcome per call.

Shared by the worker process and the inprocess backend, so both isolate failures the same way.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
import traceback
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from patchkit.core import Call, CallHook, Component, MakeMethod, call_hook
from patchkit.core.event_loop import ChunkWindow, run_inline
from patchkit.core.options import CallReport, joined
from patchkit.errors import CallError, Cancelled, ComponentError, DeadlineExceeded, PatchkitError

__all__ = [
    "COMPONENT",
    "FRONTEND",
    "WIRE",
    "COMPONENT_ERRORS",
    "Failure",
    "Outcome",
    "StopFlag",
    "component_stats",
    "ran",
    "run_batch",
    "run_calls",
    "run_calls_async",
    "setup_error",
]

T = TypeVar("T")

# Where a call failed (`Failure.source`).
COMPONENT = "component"  # its component's code raised
WIRE = "wire"  # on the way to or from the worker: its arguments or its result did not pickle or unpickle
FRONTEND = "frontend"  # the front-end gave up on it: its worker died or its batch ran past the call timeout


@dataclass
class Failure:
    """A call that failed: the exception itself when it can travel, and its text in any case."""

    error: BaseException | None
    type_name: str
    message: str
    traceback: str
    source: str = COMPONENT

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        """The component's code raised `exc`.

        A `CancelledError` or `GeneratorExit` it raised itself is its error too, carried as text only (a
        ComponentError where its caller waits): raised again as it is, it would read as the caller's own
        cancellation, or end a generator without a word.
        """
        error = exc if isinstance(exc, Exception) else None
        return cls(error, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)))

    @classmethod
    def on_wire(cls, why: str, exc: BaseException | None = None) -> Failure:
        """The call could not cross to or from its worker: `why` says which way, `exc` what pickle said."""
        message = f"{why}: {type(exc).__name__}: {exc}" if exc is not None else why
        return cls(None, type(exc).__name__ if exc is not None else "CallError", message, "", WIRE)

    @classmethod
    def verdict(cls, error: PatchkitError) -> Failure:
        """The front-end failed the call with `error` (a WorkerDiedError, a DeadlineExceeded)."""
        return cls(error, type(error).__name__, str(error), "", FRONTEND)

    def raise_for(self, component: str, method: str) -> None:
        """Raise what the call's caller sees, inside the pipeline code: called by the front-end's call hook.

        A component's own exception is raised again, so pipeline code's `except` clauses see what they
        see eagerly; it carries `component.method` for the front-end's error reply, and one that could
        not travel becomes a ComponentError with its text. A call that failed on the wire raises a
        CallError naming `component.method` and why; the front-end's verdict is raised as it is.
        """
        if self.source == WIRE:
            raise CallError(component, method, self.message)
        if self.source == FRONTEND and self.error is not None:
            raise self.error
        if self.error is not None:
            try:
                self.error.__patchkit_origin__ = (component, method, self.traceback)  # type: ignore[attr-defined]
            except AttributeError:
                pass
            else:
                raise self.error
        raise ComponentError(component, method, f"{self.type_name}: {self.message}", self.traceback)


# (True, result) or (False, Failure)
Outcome = tuple[bool, Any]
# What a component's code may raise that is its own failure: any Exception, and a CancelledError (a future
# cancelled elsewhere that it awaited) or GeneratorExit that its code raised itself. KeyboardInterrupt and
# SystemExit end the process as anywhere else.
COMPONENT_ERRORS = (Exception, asyncio.CancelledError, GeneratorExit)


def ran(outcome: Outcome) -> bool:
    """Whether the component ran the call: its result or its own error, not a verdict given in its place (a
    call its worker skipped since its request had ended, or the front-end gave up on)."""
    ok, value = outcome
    return ok or not (isinstance(value, Failure) and value.source == FRONTEND)


class StopFlag(threading.Event):
    """A call's stop: set, from any thread, when its request ends (the front-end cancels it, its stream
    ends). A call running on a thread checks it at its next chunk; one running as a task on the component
    loop is cancelled at once, by the callback it registered (`on_set`)."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], None]] = []
        self._guard = threading.Lock()

    def set(self) -> None:
        with self._guard:
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def on_set(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (on the thread that sets the flag) once it is set, at once if it is; returns what
        forgets it, for a call that ends first."""
        with self._guard:
            if not self.is_set():
                self._callbacks.append(callback)
                return lambda: self._forget(callback)
        callback()
        return lambda: None

    def _forget(self, callback: Callable[[], None]) -> None:
        with self._guard:
            if callback in self._callbacks:
                self._callbacks.remove(callback)


def run_batch(component: Component, method_name: str, calls: Sequence[Call], hook: CallHook | None = None) -> list[Outcome]:
    """`run_calls` with no chunk handed on; called by the profiler's replays, on a thread of their own. `hook`:
    what the component's own calls to the components it holds go through (`MakeMethod.run_batch`)."""
    return run_calls(component, method_name, calls, hook=hook)


def run_calls(
    component: Component,
    method_name: str,
    calls: Sequence[Call],
    on_chunk: Callable[[int, str], None] | None = None,
    cancelled: Sequence[StopFlag] | None = None,
    hook: CallHook | None = None,
    windows: Sequence[ChunkWindow | None] | None = None,
) -> list[Outcome]:
    """`run_calls_async` with `in_thread=True`, run to its end on this thread: called by the inprocess backend
    for every batch of a plain `def` method, and by `run_batch` (an `async def` method's calls then wait here
    for the component loop). A streaming call stops at its next chunk once its `cancelled` flag is set."""
    stops = cancelled if cancelled is not None else [StopFlag() for _ in calls]
    return run_inline(run_calls_async(component, method_name, calls, on_chunk, stops, [None] * len(calls), hook, windows,
                                  in_thread=True))


async def run_calls_async(
    component: Component,
    method_name: str,
    calls: Sequence[Call],
    on_chunk: Callable[[int, str], None] | None,
    stops: Sequence[StopFlag],
    deadlines: Sequence[float | None],
    hook: CallHook | None = None,
    windows: Sequence[ChunkWindow | None] | None = None,
    *,
    in_thread: bool = False,
) -> list[Outcome]:
    """Run a batch's calls, an outcome per call: the one path of every batch, whatever its method. A batch
    method's calls run as one, again one at a time if it fails in its own code, so that only the failing call
    fails; a per-item method's each alone; a `stream=True` method's chunks go to `on_chunk(index, text)` as
    they are made, a call whose reader is a whole window behind waiting where it yields (backpressure).

    Awaited on the component loop for an `async def` method (by the worker and the inprocess backend; the
    component is set up): a per-item or streaming method's calls a task each, awaiting together. A call is
    cancelled where it awaits once its stop is set (its request ended: Cancelled) or at its deadline
    (`time.monotonic()`: DeadlineExceeded); a batch method's, once every call's is. `in_thread=True` (a plain
    `def` method's, `run_calls`): each call's code runs on this thread, one after another, as plain calls, so
    the coroutine never suspends and `run_inline` runs it without a loop; a streaming call stops at its next chunk
    once its stop is set, and deadlines do not apply.
    """
    method = _method(component, method_name)
    if isinstance(method, Failure):
        return [(False, method)] * len(calls)
    if in_thread:
        return await _run(_OnThread(method, component, calls, on_chunk, stops, windows, hook))
    with call_hook(hook):  # each task starts in a copy of this context: its hook with it
        return await _run(_OnLoop(method, component, calls, on_chunk, stops, windows, hook, deadlines))


async def _run(steps: _OnThread | _OnLoop) -> list[Outcome]:
    """What a batch does, written once for both ways of taking its steps (`_OnThread`, `_OnLoop`)."""
    count = len(steps.calls)
    if not count:
        return []
    if not steps.method.batch:
        return await steps.each(steps.stream if steps.method.stream else steps.call)
    ok, value = await steps.batch(range(count))
    if ok:
        return [(True, result) for result in value]
    if count == 1 or value.source != COMPONENT:  # stopped or late: every call's verdict
        return [(False, value)] * count
    outcomes: list[Outcome] = []  # find the failing call: each alone
    for i in range(count):
        ok, value = await steps.batch([i])
        outcomes.append((True, value[0]) if ok else (False, value))
    return outcomes


async def _streamed(steps: _OnThread | _OnLoop, index: int) -> str:
    """One call of a `stream=True` method: its chunks handed on as they are made, each paced by the call's
    window; their concatenation (`joined`: an `Answer` carrying the `CallReport` it yielded last, if any).
    However it ends, its generator is closed here, now (its cleanup runs: an engine drops the sequence)."""
    chunks = steps.chunks(index)
    sink = None if steps.on_chunk is None else functools.partial(steps.on_chunk, index)
    window = None if steps.windows is None else steps.windows[index]
    parts: list[str | CallReport] = []
    try:
        while (chunk := await chunks.next()) is not None:
            parts.append(chunk)
            if sink is not None and isinstance(chunk, str):  # a report comes back with the result, not as text
                sink(chunk)
                if window is not None:
                    await chunks.pace(window)
    finally:
        await chunks.close()
    return joined(parts)


@dataclass
class _Steps:
    """A batch's calls of one `@make` method on its component, and how each step of their run is taken.

    `_run` and `_streamed` say what a batch does with its steps, once for both ways: `_OnThread` takes each
    as a plain call on the calling thread, `_OnLoop` awaits it on the component loop, where it can be
    cancelled. Each has `batch(indices)` (the batch method once over those calls), `call(i)`, `stream(i)`
    (an outcome each: a result or a failure, never an exception), `chunks(i)` and `each(step)`.
    """

    method: MakeMethod
    component: Component
    calls: Sequence[Call]
    on_chunk: Callable[[int, str], None] | None
    stops: Sequence[StopFlag]
    windows: Sequence[ChunkWindow | None] | None
    hook: CallHook | None


class _OnThread(_Steps):
    """Every step a plain call on this thread: the coroutines never suspend (`run_inline`)."""

    async def batch(self, indices: Sequence[int]) -> Outcome:
        calls = [self.calls[i] for i in indices]
        return _caught(lambda: self.method.run_batch(self.component, calls, self.hook))

    async def call(self, index: int) -> Outcome:
        return _caught(lambda: self.method.run_batch(self.component, [self.calls[index]], self.hook)[0])

    async def stream(self, index: int) -> Outcome:
        try:
            return (True, await _streamed(self, index))
        except _Stopped:
            return (False, Failure.verdict(Cancelled("its request ended while it ran: it was stopped")))
        except COMPONENT_ERRORS as exc:
            return (False, Failure.of(exc))

    def chunks(self, index: int) -> _ThreadChunks:
        args, kwargs = self.calls[index]
        return _ThreadChunks(self.method.run_chunks(self.component, args, kwargs, self.hook), self.stops[index])

    async def each(self, step: Callable[[int], Coroutine[Any, Any, Outcome]]) -> list[Outcome]:
        return [await step(i) for i in range(len(self.calls))]


@dataclass
class _OnLoop(_Steps):
    """Every step awaited on the component loop, cancelled where it awaits once its stops are set or at its
    deadline (`_guarded`); a per-item or streaming method's calls a task each, awaiting together."""

    deadlines: Sequence[float | None]

    async def batch(self, indices: Sequence[int]) -> Outcome:
        deadlines = [self.deadlines[i] for i in indices]
        latest = None if None in deadlines else max(d for d in deadlines if d is not None)
        run = self.method.run_batch_async(self.component, [self.calls[i] for i in indices], self.hook)
        return await _guarded(run, [self.stops[i] for i in indices], latest)

    async def call(self, index: int) -> Outcome:
        run = self.method.call_async(self.component, *self.calls[index])
        return await _guarded(run, [self.stops[index]], self.deadlines[index])

    async def stream(self, index: int) -> Outcome:
        return await _guarded(_streamed(self, index), [self.stops[index]], self.deadlines[index])

    def chunks(self, index: int) -> _LoopChunks:
        args, kwargs = self.calls[index]
        return _LoopChunks(self.method.achunks(self.component, args, kwargs))

    async def each(self, step: Callable[[int], Coroutine[Any, Any, Outcome]]) -> list[Outcome]:
        runs = [step(i) for i in range(len(self.calls))]
        if len(runs) > 1:
            return list(await asyncio.gather(*runs))  # a task each, awaiting together, each cancelled alone
        return [await run for run in runs]


class _Stopped(Exception):
    """A streaming call on a thread met its stop at a chunk: its request ended."""


@dataclass
class _ThreadChunks:
    """A `def` (or, through the component loop, an `async def`) streaming call's chunks, made on this thread."""

    _chunks: Generator[str | CallReport, None, None]
    _stop: threading.Event

    async def next(self) -> str | CallReport | None:
        chunk = next(self._chunks, None)
        if chunk is not None and self._stop.is_set():
            raise _Stopped
        return chunk

    async def pace(self, window: ChunkWindow) -> None:
        window.take(self._stop)

    async def close(self) -> None:
        self._chunks.close()


@dataclass
class _LoopChunks:
    """An `async def` streaming call's chunks, made on the component loop, where the call awaits them."""

    _chunks: AsyncGenerator[str | CallReport, None]

    async def next(self) -> str | CallReport | None:
        try:
            return await self._chunks.__anext__()
        except StopAsyncIteration:
            return None

    async def pace(self, window: ChunkWindow) -> None:
        await window.take_async()

    async def close(self) -> None:
        await self._chunks.aclose()


def _caught(run: Callable[[], Any]) -> Outcome:
    """`run()`'s outcome: what the component's code raised is the call's failure."""
    try:
        return (True, run())
    except COMPONENT_ERRORS as exc:
        return (False, Failure.of(exc))


async def _guarded(run: Coroutine[Any, Any, Any], stops: Sequence[StopFlag], deadline: float | None) -> Outcome:
    """`run`'s outcome, awaited in this task (no task of its own: a replica's calls cost one task each),
    which is cancelled where `run` awaits once every one of `stops` is set, or at `deadline`; a
    cancellation meant for `run` ends here, one meant for the task (the replica stops) goes on."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None  # noqa: S101 - awaited on the loop, inside a task
    why: list[PatchkitError] = []  # why `run` was cancelled, once it is
    running = True

    def stop(reason: PatchkitError) -> None:
        if running and not why:
            why.append(reason)
            task.cancel()

    def stopped() -> None:  # on the thread that set the flag
        loop.call_soon_threadsafe(stop_if_all)

    def stop_if_all() -> None:
        if all(flag.is_set() for flag in stops):
            stop(Cancelled("its request ended while it ran: it was cancelled"))

    forget = [flag.on_set(stopped) for flag in stops]
    late = DeadlineExceeded("its request ran out of time while it ran: it was cancelled")
    timer = None if deadline is None else loop.call_later(max(0.0, deadline - time.monotonic()), stop, late)
    try:
        result = await run
        if why:  # it caught the cancellation and returned: the task goes on uncancelled
            task.uncancel()
        return (True, result)
    except asyncio.CancelledError as exc:
        if task.cancelling() > len(why):  # not (only) ours: the task itself is cancelled
            raise
        if not why:  # nobody cancelled it: its code raised CancelledError itself, its own failure
            return (False, Failure.of(exc))
        task.uncancel()
        return (False, Failure.verdict(why[0]))
    except (Exception, GeneratorExit) as exc:
        return (False, Failure.of(exc))
    finally:
        running = False
        if timer is not None:
            timer.cancel()
        for undo in forget:
            undo()


def _method(component: Component, method_name: str) -> MakeMethod | Failure:
    method = getattr(type(component), method_name, None)
    if isinstance(method, MakeMethod):
        return method
    cls = type(component).__name__
    return Failure.of(ComponentError(cls, method_name, f"{cls} has no @make method {method_name!r}"))


def setup_error(name: str, exc: BaseException) -> ComponentError:
    """The error a replica whose build or `setup()` raised reports, with the component's traceback."""
    failure = Failure.of(exc)
    return ComponentError(name, "setup", f"{failure.type_name}: {failure.message}", failure.traceback)


def component_stats(component: Component) -> dict[str, Any]:
    """The component's `stats()`, or what went wrong asking for them: stats never fail a replica."""
    try:
        return json.loads(json.dumps(component.stats(), default=str))  # JSON-able, whatever it returned
    except Exception as exc:  # a component's stats() raising must not break the replica's report
        return {"error": f"{type(exc).__name__}: {exc}"}
