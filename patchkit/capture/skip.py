"""Skipping a `with` body (`capture(run=False)`): stop the frame at the first body instruction.

An exception raised at the body's first instruction lands in the with-statement's handler, where
`__exit__` swallows it. On 3.12+ the stop comes from `sys.monitoring` instruction events on that
one code object, so a debugger or coverage tool using `sys.settrace` keeps working; on 3.11 it
comes from the frame's own trace function, and a tracer that was installed is put back.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from patchkit.capture.compat import PY312

__all__ = ["BodySkipped", "Skipper"]


class BodySkipped(Exception):
    """Raised into the captured frame at its first body instruction; never escapes the block."""


class Skipper:
    """Arms a stop at `body_offset` of `frame` (`start`), and disarms it (`stop`)."""

    def __init__(self, frame: types.FrameType, body_offset: int) -> None:
        self.frame = frame
        self.body_offset = body_offset
        self._tool: int | None = None
        self._saved: tuple[Any, Any, bool] | None = None

    def start(self) -> None:
        if PY312:
            self._start_monitoring()
        else:
            self._start_tracing()

    def stop(self) -> None:
        if PY312:
            self._stop_monitoring()
        else:
            self._stop_tracing()

    def _start_monitoring(self) -> None:
        mon = sys.monitoring  # type: ignore[attr-defined]
        tool = next((t for t in range(6) if mon.get_tool(t) is None), None)
        if tool is None:
            raise RuntimeError("capture(run=False) needs a free sys.monitoring tool id; all six are in use")
        mon.use_tool_id(tool, "patchkit-capture")
        frame, offset = self.frame, self.body_offset

        def on_instruction(code: types.CodeType, at: int) -> Any:
            if code is frame.f_code and at >= offset and sys._getframe(1) is frame:
                # once only: the with-statement's handler runs at later offsets of the same code
                mon.set_local_events(tool, code, 0)
                raise BodySkipped
            return None

        mon.register_callback(tool, mon.events.INSTRUCTION, on_instruction)
        mon.set_local_events(tool, frame.f_code, mon.events.INSTRUCTION)
        self._tool = tool

    def _stop_monitoring(self) -> None:
        if self._tool is None:
            return
        mon = sys.monitoring  # type: ignore[attr-defined]
        mon.set_local_events(self._tool, self.frame.f_code, 0)
        mon.register_callback(self._tool, mon.events.INSTRUCTION, None)
        mon.free_tool_id(self._tool)
        self._tool = None

    def _start_tracing(self) -> None:
        frame, offset = self.frame, self.body_offset
        self._saved = (sys.gettrace(), frame.f_trace, frame.f_trace_opcodes)

        def on_event(f: types.FrameType, event: str, arg: Any) -> Any:
            if f is frame and event in ("line", "opcode") and f.f_lasti >= offset:
                f.f_trace_opcodes = False
                f.f_trace = None  # once only: the with-statement's handler runs at later offsets
                raise BodySkipped
            return on_event

        if sys.gettrace() is None:
            sys.settrace(_no_trace)  # frame tracing only runs while a global trace function is set
        frame.f_trace_opcodes = True
        frame.f_trace = on_event

    def _stop_tracing(self) -> None:
        if self._saved is None:
            return
        global_trace, frame_trace, opcodes = self._saved
        self.frame.f_trace = frame_trace
        self.frame.f_trace_opcodes = opcodes
        sys.settrace(global_trace)
        self._saved = None


def _no_trace(frame: types.FrameType, event: str, arg: Any) -> None:
    return None
