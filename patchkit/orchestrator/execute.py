"""Running one batch of calls on a component, with an outcome per call.

Shared by the worker process and the inprocess backend, so both isolate failures the same way.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import traceback
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

from patchkit.core import Call, CallHook, Component, MakeMethod, call_hook
from patchkit.core.event_loop import ChunkWindow
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
    "run_streamed",
    "setup_error",
]

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
    """Run `calls` as one batch; a failing batch method is re-run call by call to find the failing call.

    Called by a worker for every batch message, by the inprocess backend on its replica thread.
    `hook`: what the component's own calls to the components it holds go through (`MakeMethod.run_batch`).
    """
    method = _method(component, method_name)
    if isinstance(method, Failure):
        return [(False, method)] * len(calls)
    if method.batch and len(calls) > 1:
        try:
            return [(True, result) for result in method.run_batch(component, calls, hook)]
        except COMPONENT_ERRORS:  # noqa: S110 - re-run one by one below, so only the failing call fails
            pass
    return [_run_one(method, component, call, hook) for call in calls]


def run_calls(
    component: Component,
    method_name: str,
    calls: Sequence[Call],
    on_chunk: Callable[[int, str], None] | None = None,
    cancelled: Sequence[threading.Event] | None = None,
    hook: CallHook | None = None,
    windows: Sequence[ChunkWindow | None] | None = None,
) -> list[Outcome]:
    """Run a batch's calls: as `run_batch`, but a `stream=True` method's calls one by one through
    `run_streamed`, their chunks handed to `on_chunk(index, text)`, each paced by its window (None: not
    paced) and stopped once its `cancelled` event is set. Called by the worker and the inprocess backend
    for every batch."""
    method = getattr(type(component), method_name, None)
    if not (isinstance(method, MakeMethod) and method.stream):
        return run_batch(component, method_name, calls, hook)
    outcomes = []
    for i, call in enumerate(calls):
        sink = (lambda text, i=i: on_chunk(i, text)) if on_chunk is not None else None
        stop = cancelled[i] if cancelled is not None else threading.Event()
        window = windows[i] if windows is not None else None
        outcomes.append(run_streamed(component, method_name, call, sink, stop, hook, window))
    return outcomes


def run_streamed(
    component: Component,
    method_name: str,
    call: Call,
    on_chunk: Callable[[str], None] | None,
    cancelled: threading.Event,
    hook: CallHook | None = None,
    window: ChunkWindow | None = None,
) -> Outcome:
    """One call of a `stream=True` method: each chunk handed to `on_chunk` as it is made (None: kept
    only), its outcome their concatenation. With a `window`, the generator waits after a chunk while its
    reader is a whole window behind (backpressure: it is not asked for its next chunk). Once `cancelled`
    is set the method's generator is closed at its next chunk (an engine then drops the sequence) and the
    outcome says Cancelled."""
    method = _method(component, method_name)
    if isinstance(method, Failure):
        return (False, method)
    parts: list[str] = []
    try:
        chunks = method.run_chunks(component, *call, hook)
        try:
            for chunk in chunks:
                if cancelled.is_set():
                    return (False, Failure.verdict(Cancelled("its request ended while it ran: it was stopped")))
                parts.append(chunk)
                if on_chunk is not None:
                    on_chunk(chunk)
                    if window is not None:
                        window.take(cancelled)
        finally:
            chunks.close()
    except COMPONENT_ERRORS as exc:
        return (False, Failure.of(exc))
    return (True, "".join(parts))


async def run_calls_async(
    component: Component,
    method_name: str,
    calls: Sequence[Call],
    on_chunk: Callable[[int, str], None] | None,
    stops: Sequence[StopFlag],
    deadlines: Sequence[float | None],
    hook: CallHook | None = None,
    windows: Sequence[ChunkWindow | None] | None = None,
) -> list[Outcome]:
    """Run a batch of an `async def` method's calls on the component loop, where the worker and the inprocess
    backend await it; the component is set up. `run_calls` for coroutines: the calls of a per-item or
    streaming method run all at once (a task each, awaiting together without a thread); a batch method's
    calls as one, re-run one by one if it fails,
    so that only the failing call fails. A call is cancelled where it awaits once its stop is set (its
    request ended: the outcome says Cancelled) or at its deadline (`time.monotonic()`; the outcome says
    DeadlineExceeded); a batch method's, once every call's is. A streaming call with a window waits
    where it yields while its reader is a whole window behind."""
    method = _method(component, method_name)
    if isinstance(method, Failure):
        return [(False, method)] * len(calls)
    with call_hook(hook):  # each task starts in a copy of this context: its hook with it
        if method.batch:
            return await _batch_async(method, component, calls, stops, deadlines, hook)
        runs = [
            _guarded(_one_async(method, component, call, None if on_chunk is None else _sink(on_chunk, i),
                                None if windows is None else windows[i]), [stop], deadline)
            for i, (call, stop, deadline) in enumerate(zip(calls, stops, deadlines))
        ]
        if len(runs) > 1:
            return list(await asyncio.gather(*runs))  # a task each, awaiting together, each cancelled alone
        return [await run for run in runs]


def _sink(on_chunk: Callable[[int, str], None], index: int) -> Callable[[str], None]:
    return lambda text: on_chunk(index, text)


async def _one_async(
    method: MakeMethod, component: Component, call: Call, on_chunk: Callable[[str], None] | None, window: ChunkWindow | None
) -> Any:
    args, kwargs = call
    if not method.stream:
        return await method.call_async(component, args, kwargs)
    parts: list[str] = []
    chunks = method.achunks(component, args, kwargs)
    try:
        async for chunk in chunks:
            parts.append(chunk)
            if on_chunk is not None:
                on_chunk(chunk)
                if window is not None:
                    await window.take_async()
    finally:
        await chunks.aclose()  # at once, here: a call cancelled mid-stream runs its generator's cleanup now
    return "".join(parts)


async def _batch_async(
    method: MakeMethod, component: Component, calls: Sequence[Call], stops: Sequence[StopFlag],
    deadlines: Sequence[float | None], hook: CallHook | None,
) -> list[Outcome]:
    latest = None if any(deadline is None for deadline in deadlines) else max(d for d in deadlines if d is not None)
    ok, value = await _guarded(method.run_batch_async(component, calls, hook), stops, latest)
    if ok:
        return [(True, result) for result in value]
    if len(calls) == 1 or value.source != COMPONENT:
        return [(False, value)] * len(calls)
    outcomes: list[Outcome] = []  # find the failing call: each alone
    for call, stop, deadline in zip(calls, stops, deadlines):
        ok, value = await _guarded(method.run_batch_async(component, [call], hook), [stop], deadline)
        outcomes.append((True, value[0]) if ok else (False, value))
    return outcomes


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


def _run_one(method: MakeMethod, component: Component, call: Call, hook: CallHook | None) -> Outcome:
    try:
        return (True, method.run_batch(component, [call], hook)[0])
    except COMPONENT_ERRORS as exc:
        return (False, Failure.of(exc))


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
