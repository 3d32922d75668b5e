"""Running one batch of calls on a component, with an outcome per call.

Shared by the worker process and the inprocess backend, so both isolate failures the same way.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from patchkit.component import Call, Component, MakeMethod
from patchkit.errors import ComponentError

__all__ = ["Failure", "Outcome", "component_stats", "run_batch", "setup_error"]


@dataclass
class Failure:
    """A call that raised: the exception itself when it can travel, and its text in any case."""

    error: BaseException | None
    type_name: str
    message: str
    traceback: str

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        return cls(exc, type(exc).__name__, str(exc), "".join(traceback.format_exception(exc)))

    def raise_for(self, component: str, method: str) -> None:
        """Re-raise the component's own exception, so pipeline code's `except` clauses see what they see eagerly.

        The exception carries `component.method` for the front-end's error reply; an exception that
        could not travel becomes a ComponentError with its text.
        """
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


def run_batch(component: Component, method_name: str, calls: Sequence[Call]) -> list[Outcome]:
    """Run `calls` as one batch; a failing batch method is re-run call by call to find the failing call.

    Called by a worker for every batch message, by the inprocess backend on its replica thread.
    """
    method = getattr(type(component), method_name, None)
    if not isinstance(method, MakeMethod):
        cls = type(component).__name__
        error = ComponentError(cls, method_name, f"{cls} has no @make method {method_name!r}")
        return [(False, Failure.of(error))] * len(calls)
    if method.batch and len(calls) > 1:
        try:
            return [(True, result) for result in method.run_batch(component, calls)]
        except Exception:  # noqa: S110 - re-run one by one below, so only the failing call fails
            pass
    return [_run_one(method, component, call) for call in calls]


def _run_one(method: MakeMethod, component: Component, call: Call) -> Outcome:
    try:
        return (True, method.run_batch(component, [call])[0])
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
