"""Recording of component calls during eager runs: the capture run and `pipeline(...)` calls.

Each call is stored with its inputs, output, duration and call site; the profiler replays the
inputs, and the graph counts visits per call site.
"""

from __future__ import annotations

import functools
import sys
import time
import types
import weakref
from dataclasses import dataclass
from typing import Any

from patchkit.capture.holders import constructor_components
from patchkit.component import Component, MakeMethod

__all__ = ["CallRecord", "CallSite", "Recorder", "site_of"]


@dataclass(frozen=True)
class CallSite:
    """Where in the user's source a component method is called: the key of a graph node."""

    filename: str
    lineno: int
    col: int
    end_col: int


@dataclass(frozen=True)
class CallRecord:
    component: Component
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    seconds: float
    site: CallSite | None


_POSITIONS: weakref.WeakKeyDictionary[types.CodeType, list[Any]] = weakref.WeakKeyDictionary()


def site_of(frame: types.FrameType) -> CallSite | None:
    """The call site of the instruction `frame` is executing (a CALL), from the code's positions."""
    code = frame.f_code
    positions = _POSITIONS.get(code)
    if positions is None:
        positions = _POSITIONS[code] = list(code.co_positions())
    index = frame.f_lasti // 2
    if index >= len(positions) or positions[index][0] is None:
        return None
    line, _, col, end_col = positions[index]
    return CallSite(code.co_filename, line, col or 0, end_col or 0)


class Recorder:
    """A CallHook that runs each call locally and records it. One per eager run."""

    def __init__(self) -> None:
        self.calls: list[CallRecord] = []

    def __call__(self, component: Component, method: MakeMethod, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Frame 0 is this method, 1 is BoundMake.__call__, 2 the user's code making the call.
        return self._record(component, method, args, kwargs, site_of(sys._getframe(2)))

    def _record(
        self, component: Component, method: MakeMethod, args: tuple[Any, ...], kwargs: dict[str, Any], site: CallSite | None
    ) -> Any:
        start = time.perf_counter()
        shared = {inner._patchkit_spec.uid for _, inner in constructor_components(component)}
        hook = functools.partial(self._inner, shared, f"<{type(component).__name__}.{method.name}>") if shared else None
        output = method.run_batch(component, [(args, kwargs)], hook)[0]  # a component's own calls run in place
        self.calls.append(CallRecord(component, method.name, args, kwargs, output, time.perf_counter() - start, site))
        return output

    def _inner(
        self, shared: set[str], where: str, component: Component, method: MakeMethod, args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """A call a component makes: recorded (at a site named after its caller) when it calls a component
        passed to its constructor, which a deployment serves on its own; any other runs in place, unrecorded."""
        if component._patchkit_spec.uid not in shared:
            return method.run_local(component, args, kwargs)
        return self._record(component, method, args, kwargs, CallSite(where, 0, 0, 0))
