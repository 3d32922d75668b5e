"""Running one batch of calls on a component, with an outcome per call.

Shared by the worker process and the inprocess backend, so both isolate failures the same way.
"""

from __future__ import annotations

import json
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from patchkit.component import Call, CallHook, Component, MakeMethod
from patchkit.errors import CallError, Cancelled, ComponentError, PatchkitError

__all__ = [
    "COMPONENT",
    "FRONTEND",
    "WIRE",
    "Failure",
    "Outcome",
    "component_stats",
    "run_batch",
    "run_calls",
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
        """The component's code raised `exc`."""
        return cls(exc, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)))

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
        except Exception:  # noqa: S110 - re-run one by one below, so only the failing call fails
            pass
    return [_run_one(method, component, call, hook) for call in calls]


def run_calls(
    component: Component,
    method_name: str,
    calls: Sequence[Call],
    on_chunk: Callable[[int, str], None] | None = None,
    cancelled: Sequence[threading.Event] | None = None,
    hook: CallHook | None = None,
) -> list[Outcome]:
    """Run a batch's calls: as `run_batch`, but a `stream=True` method's calls one by one through
    `run_streamed`, their chunks handed to `on_chunk(index, text)` and each stopped once its
    `cancelled` event is set. Called by the worker and the inprocess backend for every batch."""
    method = getattr(type(component), method_name, None)
    if not (isinstance(method, MakeMethod) and method.stream):
        return run_batch(component, method_name, calls, hook)
    outcomes = []
    for i, call in enumerate(calls):
        sink = (lambda text, i=i: on_chunk(i, text)) if on_chunk is not None else None
        stop = cancelled[i] if cancelled is not None else threading.Event()
        outcomes.append(run_streamed(component, method_name, call, sink, stop, hook))
    return outcomes


def run_streamed(
    component: Component,
    method_name: str,
    call: Call,
    on_chunk: Callable[[str], None] | None,
    cancelled: threading.Event,
    hook: CallHook | None = None,
) -> Outcome:
    """One call of a `stream=True` method: each chunk handed to `on_chunk` as it is made (None: kept
    only), its outcome their concatenation. Once `cancelled` is set the method's generator is closed
    at its next chunk (an engine then drops the sequence) and the outcome says Cancelled."""
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
        finally:
            chunks.close()
    except Exception as exc:
        return (False, Failure.of(exc))
    return (True, "".join(parts))


def _method(component: Component, method_name: str) -> MakeMethod | Failure:
    method = getattr(type(component), method_name, None)
    if isinstance(method, MakeMethod):
        return method
    cls = type(component).__name__
    return Failure.of(ComponentError(cls, method_name, f"{cls} has no @make method {method_name!r}"))


def _run_one(method: MakeMethod, component: Component, call: Call, hook: CallHook | None) -> Outcome:
    try:
        return (True, method.run_batch(component, [call], hook)[0])
    except Exception as exc:
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
