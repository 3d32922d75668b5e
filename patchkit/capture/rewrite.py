"""Rewrites of a captured body that keep its meaning once it runs outside the frame it came from.

Zero-argument `super()` finds its class in the frame's `__class__` cell and its object in the
frame's first argument. The rebuilt pipeline function has neither (its parameters are keyword-only
and `__class__` is one of its own cells), so every `super()` of the block is made explicit:
`super(__class__, self)`, with `__class__` and `self` read like any other variable of the block
(both are bound by identity: a class, and the method's own object).
"""

from __future__ import annotations

import types
from collections.abc import Iterable
from typing import Any

from bytecode import CellVar, FreeVar, Instr

from patchkit.capture.compat import HAS_SUPER_ATTR, ZERO_ARG_CALL

__all__ = ["explicit_super"]

CLASS_CELL = "__class__"


def explicit_super(body: Iterable[Any], code: types.CodeType) -> list[Any]:
    """`body` with every zero-argument `super()` given its two arguments explicitly.

    Only a method's code (one that has the compiler's `__class__` cell and a first argument) can
    call `super()` without arguments; any other body comes back unchanged.
    """
    elements = list(body)
    if CLASS_CELL not in code.co_freevars or code.co_argcount < 1:
        return elements
    first = code.co_varnames[0]
    receiver = CellVar(first) if first in code.co_cellvars else first

    def loads(location: Any) -> list[Instr]:
        return [
            Instr("LOAD_DEREF", FreeVar(CLASS_CELL), location=location),
            Instr("LOAD_DEREF" if isinstance(receiver, CellVar) else "LOAD_FAST", receiver, location=location),
        ]

    out: list[Any] = []
    i = 0
    while i < len(elements):
        e = elements[i]
        if _is_super_load(e) and _is_zero_arg_call(elements[i + 1 : i + 1 + len(ZERO_ARG_CALL)]):
            calls = elements[i + 1 : i + 1 + len(ZERO_ARG_CALL)]
            out += [e, *loads(calls[-1].location)]
            out += [Instr(c.name, 2, location=c.location) for c in calls]
            i += 1 + len(ZERO_ARG_CALL)
            continue
        if HAS_SUPER_ATTR and isinstance(e, Instr) and e.name == "LOAD_SUPER_ATTR" and not e.arg[1]:
            e = Instr("LOAD_SUPER_ATTR", (e.arg[0], True, e.arg[2]), location=e.location)
        out.append(e)
        i += 1
    return out


def _is_super_load(e: Any) -> bool:
    return isinstance(e, Instr) and e.name == "LOAD_GLOBAL" and e.arg == (True, "super")


def _is_zero_arg_call(seq: list[Any]) -> bool:
    return len(seq) == len(ZERO_ARG_CALL) and all(
        isinstance(e, Instr) and e.name == name and e.arg == 0 for e, name in zip(seq, ZERO_ARG_CALL)
    )
