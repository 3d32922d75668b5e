"""Recording of component calls during eager runs: the capture run and `pipeline(...)` calls.

Each call is stored with its inputs, output, duration and call site; the profiler replays the
inputs, and the graph counts visits per call site.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

from patchkit.capture.holders import constructor_components
from patchkit.core import CallSite, Component, MakeMethod

__all__ = ["CallRecord", "Recorder"]


@dataclass(frozen=True)
class CallRecord:
    component: Component
    method: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    seconds: float
    site: CallSite | None


class Recorder:
    """A CallHook that runs each call locally and records it. One per eager run."""

    def __init__(self) -> None:
        self.calls: list[CallRecord] = []

    def __call__(
        self, component: Component, method: MakeMethod, args: tuple[Any, ...], kwargs: dict[str, Any], site: CallSite | None
    ) -> Any:
        return self._record(component, method, args, kwargs, site)

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
        kwargs: dict[str, Any], site: CallSite | None,
    ) -> Any:
        """A call a component makes: recorded (at a site named after its caller) when it calls a component
        passed to its constructor, which a deployment serves on its own; any other runs in place, unrecorded."""
        if component._patchkit_spec.uid not in shared:
            return method.run_local(component, args, kwargs)
        return self._record(component, method, args, kwargs, CallSite(where, 0, 0, 0))
