"""Frame -> variables: which names of the capturing frame become inputs, and which are bound.

A name the body reads before writing and that is bound when the block is entered is either an
input (a plain value: its value at capture is the default) or a bound object (a Component,
module, function or class, an object that holds components, or the method's own `self`),
passed by identity on every run.

Two rules keep a pipeline from losing data silently, each a `CaptureError` naming the fix:
- a block that returns on some paths, and on another ends where code follows the block (not a
  `return` at once), must name what that path gives (`capture(output=...)`);
- a helper function defined before the block may read the block's variables (its inputs and
  the names it assigns) only through its arguments: read as a global at module level, or
  through its closure inside a function, it would see the value at capture on every run.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bytecode import Instr

from patchkit.capture.analysis import default_output, global_reads, instr_reads, instr_writes, live_in
from patchkit.capture.holders import holds_components
from patchkit.capture.ir import BlockExit, CapturedBlock
from patchkit.core import Component
from patchkit.errors import CaptureError

__all__ = [
    "FrameVariables",
    "is_bound_object",
    "method_receiver",
    "refuse_stale_helpers",
    "resolve_output",
    "split_variables",
]

RETURN = "return"


@dataclass(frozen=True)
class FrameVariables:
    inputs: dict[str, Any]
    bindings: dict[str, Any]


def is_bound_object(value: Any) -> bool:
    """True for what a pipeline binds by identity rather than taking as an input."""
    if isinstance(value, (Component, types.ModuleType, type)) or inspect.isroutine(value):
        return True
    return holds_components(value)


def method_receiver(code: types.CodeType, namespace: Mapping[str, Any]) -> str | None:
    """The name of the method's own object (`self`) when `code` is a method of that object's class.

    Found by identity, not by name: the first argument's class (or a base) holds a function
    with this very code object, so a staticmethod's first argument is never taken for `self`.
    """
    if code.co_argcount < 1 or code.co_varnames[0] not in namespace:
        return None
    first = code.co_varnames[0]
    for klass in type(namespace[first]).__mro__:
        for attr in vars(klass).values():
            if _code_of(attr) is code:
                return first
    return None


def _code_of(attr: Any) -> types.CodeType | None:
    fn = attr.__func__ if isinstance(attr, (classmethod, staticmethod)) else attr
    for _ in range(8):  # decorators that keep `__wrapped__` (functools.wraps)
        code = getattr(fn, "__code__", None)
        if code is not None or not hasattr(fn, "__wrapped__"):
            return code if isinstance(code, types.CodeType) else None
        fn = fn.__wrapped__
    return None


def frame_namespace(frame: types.FrameType, scope: str) -> dict[str, Any]:
    """The names bound in `frame` right now, as the block would see them."""
    if scope == "function":
        return dict(frame.f_locals)
    return {**frame.f_globals, **frame.f_locals}


def resolve_output(block: CapturedBlock, output: str | None, namespace: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """(variable returned where the body ends, what `Pipeline.output` reports).

    `capture(output="x")` names it; else a block with `return` outputs what it returns; else the
    name the block assigns last.
    """
    if output is not None:
        if not output.isidentifier():
            raise CaptureError(f"output={output!r}", filename=block.filename, lineno=block.with_lineno, hint="Name one variable.")
        written = {n for e in block.body if hasattr(e, "name") for n in instr_writes(e)}
        if output not in written and output not in namespace:
            close = difflib.get_close_matches(output, sorted(written), n=1)
            hint = f"Did you mean {close[0]!r}?" if close else "Assign it inside the block."
            raise CaptureError(
                f"output={output!r}: the block never assigns it",
                filename=block.filename,
                lineno=block.with_lineno,
                hint=hint,
            )
        return output, output
    if block.has_return:
        _refuse_mixed_ends(block)
        return None, RETURN
    name = default_output(block)
    return name, name


def _refuse_mixed_ends(block: CapturedBlock) -> None:
    """A block with `return` whose other paths end without one: what they give is not in the block."""
    ends = [e for e in block.body if isinstance(e, BlockExit)]
    if not ends:
        return
    returns = [e.lineno for e in block.body if isinstance(e, Instr) and e.name == "RETURN_VALUE" and e.lineno]
    returned = f" (line {min(returns)})" if returns else ""
    ended = sorted({e.left_at for e in ends if e.left_at})
    where = f" (line {ended[0]})" if ended else ""
    name = default_output(block) or "answer"
    raise CaptureError(
        f"a block that returns on one path{returned} and ends without `return` on another{where}",
        filename=block.filename,
        lineno=block.with_lineno,
        hint=(
            "Name the variable a path without `return` gives: "
            f"`with patchkit.capture(output={name!r}):`, or end every path with `return`."
        ),
    )


def split_variables(
    block: CapturedBlock, namespace: Mapping[str, Any], output: str | None, receiver: str | None = None
) -> FrameVariables:
    """Inputs and bound objects of the block, from the frame's names at the time of capture.

    `receiver` names the method's own object (see `method_receiver`): bound whatever it holds.
    """
    inputs: dict[str, Any] = {}
    bindings: dict[str, Any] = {}
    for name in sorted(live_in(block, output)):
        if name not in namespace:
            continue
        value = namespace[name]
        (bindings if name == receiver or is_bound_object(value) else inputs)[name] = value
    return FrameVariables(inputs, bindings)


def refuse_stale_helpers(
    block: CapturedBlock, variables: FrameVariables, module_globals: Mapping[str, Any], code: types.CodeType
) -> None:
    """Refuse a bound helper that reads a variable of the block other than through its arguments.

    A block runs in a namespace of its own on every run (a fresh one at module level, the
    rebuilt function's cells inside a function); a helper defined before the block keeps reading
    the module's globals or the original frame's cells, which hold the values of the capture run.
    """
    block_names = set(variables.inputs) | {n for e in block.body if isinstance(e, Instr) for n in instr_writes(e)}
    nested = _nested_codes(code)
    for name, value in sorted(variables.bindings.items()):
        fn = _function_of(value)
        if fn is None:
            continue
        found = _stale_read(fn, block.scope, block_names, module_globals, nested, set())
        if found is None:
            continue
        helper, variable = found
        how = "as a global" if block.scope == "module" else "through its closure"
        via = f", called through `{name}`" if helper.__name__ != name else ""
        hcode = helper.__code__
        raise CaptureError(
            f"the helper `{helper.__name__}` ({hcode.co_filename}:{hcode.co_firstlineno}{via}), which reads `{variable}` {how}",
            filename=block.filename,
            lineno=_first_use(block, name),
            hint=(
                f"In a pipeline it would see the value `{variable}` had at capture, not the request's. "
                f"Pass it as an argument: `def {helper.__name__}({variable}, ...)`, called as "
                f"`{helper.__name__}({variable}, ...)` in the block."
            ),
        )


def _function_of(value: Any) -> types.FunctionType | None:
    for _ in range(8):
        if isinstance(value, types.FunctionType):
            return value
        if isinstance(value, types.MethodType):
            value = value.__func__
        elif isinstance(value, functools.partial):
            value = value.func
        elif hasattr(value, "__wrapped__") and not isinstance(value, type):
            value = value.__wrapped__
        else:
            return None
    return None


def _stale_read(
    fn: types.FunctionType,
    scope: str,
    block_names: set[str],
    module_globals: Mapping[str, Any],
    nested: set[int],
    seen: set[int],
) -> tuple[types.FunctionType, str] | None:
    """(helper, variable) for the first variable of the block `fn` reads stale, directly or through
    the helpers it calls; None when it reads none."""
    if id(fn) in seen:
        return None
    seen.add(id(fn))
    if scope == "module":
        if fn.__globals__ is not module_globals:
            return None
        reads = global_reads(fn.__code__)
        callees = [module_globals.get(r) for r in sorted(reads - block_names)]
    else:
        if id(fn.__code__) not in nested:
            return None
        reads = set(fn.__code__.co_freevars)
        callees = [c.cell_contents for c in fn.__closure__ or () if _is_filled(c)]
    hits = sorted(reads & block_names)
    if hits:
        return fn, hits[0]
    for callee in callees:
        inner = _function_of(callee)
        if inner is not None:
            found = _stale_read(inner, scope, block_names, module_globals, nested, seen)
            if found is not None:
                return found
    return None


def _is_filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _nested_codes(code: types.CodeType) -> set[int]:
    """Identities of the code objects defined inside `code` (functions, lambdas, comprehensions),
    recursively. By identity: equal code objects of two places compare equal."""
    found: set[int] = set()
    todo = [code]
    while todo:
        for const in todo.pop().co_consts:
            if isinstance(const, types.CodeType) and id(const) not in found:
                found.add(id(const))
                todo.append(const)
    return found


def _first_use(block: CapturedBlock, name: str) -> int:
    for e in block.body:
        if isinstance(e, Instr) and name in instr_reads(e, block.scope) and e.lineno:
            return e.lineno
    return block.with_lineno
