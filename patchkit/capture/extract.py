"""Bytecode -> IR: cut the body of a `with` statement out of a code object.

The body is found by control flow, not by line numbers: starting after the `as` store, follow
fall-through, jumps and the handlers of nested `try` blocks until an exit sequence, the
`__exit__(None, None, None)` call that the compiler emits wherever control leaves the block
(its end, a `return`, a `break`). Exit sequences of nested `with` statements are told apart by
exception-table coverage: the block's own exit call is not protected by its own handler.

The block's own exception-table range bounds the walk: a handler is followed only when an
exception inside it still reaches the block's own handler, so it lies inside the block. The
handler of a statement around the block (an outer `with`, a `try/finally`, the other item of
`with a(), patchkit.capture():`) also covers the exit sequence the compiler emits at the block's
end; it belongs to the enclosing code and never becomes part of the body.
"""

from __future__ import annotations

import dis
import types
from dataclasses import dataclass
from typing import Any

from bytecode import Bytecode, Instr, Label, SetLineno, TryBegin, TryEnd

from patchkit.capture.compat import EXIT_CALL, SUSPENDING, name_of
from patchkit.capture.ir import BlockExit, CapturedBlock
from patchkit.capture.rewrite import explicit_super
from patchkit.errors import CaptureError

__all__ = ["extract_block"]

AS_TARGETS = frozenset({"STORE_NAME", "STORE_FAST", "STORE_DEREF", "STORE_GLOBAL", "POP_TOP"})
UNWIND = frozenset({"POP_TOP", "POP_EXCEPT", "NOP", "SWAP"})
RETURNED_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_NAME"})
CO_OPTIMIZED = 0x1


@dataclass(frozen=True)
class _Exit:
    """One way out of the block: a `return` inside it ("value", "const") or not ("normal").

    `then` holds, for a normal exit, the code the function runs right after the block on that
    path when that code returns at once (`return answer`, `return None`, the function's end).
    """

    kind: str  # "value" | "const" | "normal"
    value: Any = None
    then: tuple[Instr, ...] | None = None


class _Walker:
    """Indexes of one code object's abstract instruction list: labels, handlers, exit sequences."""

    def __init__(self, code: types.CodeType, elements: list[Any]) -> None:
        self.code = code
        self.elements = elements
        self.label_at = {id(e): i for i, e in enumerate(elements) if isinstance(e, Label)}
        self.handler: dict[int, Label] = {}
        current: TryBegin | None = None
        for i, e in enumerate(elements):
            if isinstance(e, TryBegin):
                current = e
            elif isinstance(e, TryEnd):
                current = None
            elif isinstance(e, Instr) and current is not None:
                self.handler[i] = current.target

    def instrs_from(self, i: int) -> list[tuple[int, Instr]]:
        """The real instructions from index i on, in fall-through order, following plain jumps."""
        out: list[tuple[int, Instr]] = []
        seen = set()
        while i < len(self.elements) and len(out) < 12 and i not in seen:
            seen.add(i)
            e = self.elements[i]
            if isinstance(e, Instr):
                if e.is_uncond_jump() and out:
                    i = self.label_at[id(e.arg)]
                    continue
                out.append((i, e))
            i += 1
        return out

    def protected_by(self, i: int, handler: Label, memo: dict[int, bool]) -> bool:
        """Whether an exception at element i reaches `handler` (directly or through nested handlers)."""
        if i in memo:
            return memo[i]
        memo[i] = False
        own = self.handler.get(i)
        if own is None:
            return False
        if own is handler:
            memo[i] = True
            return True
        first = next((j for j, _ in self.instrs_from(self.label_at[id(own)])), None)
        memo[i] = first is not None and self.protected_by(first, handler, memo)
        return memo[i]

    def exit_at(self, i: int, with_line: int) -> _Exit | None:
        """The kind of block exit starting at instruction i, or None when i is no exit sequence.

        A `return` of a constant inside the block compiles to a NOP on its own line, the block's
        exit, the unwinding of the statements around the block (their `__exit__` calls, a
        `finally` body), then the constant's load and RETURN on the `with` line or an outer
        statement's. A return on the straight path after the block's end is the code after it.
        `return None` and the function's implicit end compile alike: a normal exit whose `then`
        returns None, which is what the function returns either way.
        """
        seq = self.instrs_from(i)
        ops = [e.name for _, e in seq]
        value = ops[:1] == ["SWAP"] and seq[0][1].arg == 2
        start = 1 if value else 0
        call = ops[start : start + len(EXIT_CALL) + 1]
        if tuple(call) != EXIT_CALL + ("POP_TOP",):
            return None
        if any(e.arg is not None for _, e in seq[start : start + 3]) or seq[start + len(EXIT_CALL) - 1][1].arg != 2:
            return None
        if value:
            return _Exit("value")
        rest = [e for _, e in seq[start + len(EXIT_CALL) + 1 :]]
        while rest and rest[0].name in UNWIND:
            rest.pop(0)
        then = _returns_at_once(rest)
        const = self.returned_constant(seq[start + len(EXIT_CALL)][0] + 1)
        on_with_line = then is not None and then[-1].lineno == with_line
        if const is not None and (on_with_line or self.after_statement_without_code(i)):
            return _Exit("const", const)
        return _Exit("normal", then=tuple(e.copy() for e in then) if then is not None else None)

    def returned_constant(self, j: int) -> Any:
        """The constant (not None) the function returns on the straight path from element j, or None
        when that path branches, returns something else or runs on for long."""
        prev: Instr | None = None
        seen: set[int] = set()
        while j < len(self.elements) and len(seen) < 64 and j not in seen:
            seen.add(j)
            e = self.elements[j]
            j += 1
            if not isinstance(e, Instr):
                continue
            if e.name == "RETURN_CONST":
                return e.arg
            if e.name == "RETURN_VALUE":
                return prev.arg if prev is not None and prev.name == "LOAD_CONST" else None
            if e.is_uncond_jump():
                j, prev = self.label_at[id(e.arg)], None
                continue
            if e.has_jump() or e.is_final():
                return None
            prev = e
        return None

    def after_statement_without_code(self, i: int) -> bool:
        """Whether a NOP, which marks the line of a statement that compiles to no code of its own
        there (`return <constant>`, `break`, `pass`), comes right before element i."""
        before = next((e for e in reversed(self.elements[:i]) if isinstance(e, Instr)), None)
        return before is not None and before.name == "NOP"


def _returns_at_once(rest: list[Instr]) -> list[Instr] | None:
    """The leading `return <constant or variable>` of `rest`, or None when it does more first."""
    if rest and rest[0].name == "RETURN_CONST":
        return rest[:1]
    if len(rest) >= 2 and rest[1].name == "RETURN_VALUE":
        load = rest[0]
        if load.name == "LOAD_CONST" or load.name in RETURNED_LOADS:
            return rest[:2]
        if load.name == "LOAD_GLOBAL" and not load.arg[0]:
            return rest[:2]
    return None


def _loads(then: tuple[Instr, ...] | None, name: str) -> bool:
    return then is not None and any(e.name in RETURNED_LOADS and name_of(e.arg) == name for e in then)


def _with_index(code: types.CodeType, elements: list[Any], offset: int) -> int:
    """Index in `elements` of the BEFORE_WITH at byte `offset` of `code`."""
    rank = sum(1 for ins in dis.get_instructions(code) if ins.opname == "BEFORE_WITH" and ins.offset < offset)
    withs = [i for i, e in enumerate(elements) if isinstance(e, Instr) and e.name == "BEFORE_WITH"]
    return withs[rank]


def _body_offset(code: types.CodeType, offset: int) -> int:
    """Byte offset of the first instruction after the `as` store that follows BEFORE_WITH."""
    after = [i for i in dis.get_instructions(code) if i.offset > offset and i.opname not in ("EXTENDED_ARG", "CACHE")]
    return after[1].offset if len(after) > 1 else after[0].offset


def extract_block(code: types.CodeType, with_offset: int) -> CapturedBlock:
    """Cut the body of the `with` statement whose BEFORE_WITH sits at `with_offset` out of `code`.

    Raises CaptureError, naming the user's file and line, for what a pipeline cannot hold.
    """
    elements = list(Bytecode.from_code(code))
    walker = _Walker(code, elements)
    w = _with_index(code, elements, with_offset)
    with_line = elements[w].lineno or code.co_firstlineno
    store_at = next(i for i in range(w + 1, len(elements)) if isinstance(elements[i], Instr))
    as_store = elements[store_at]
    own = next((e for e in reversed(elements[w + 1 : store_at]) if isinstance(e, TryBegin)), None)
    if own is None or as_store.name not in AS_TARGETS:
        raise CaptureError(
            "this `as` target",
            filename=code.co_filename,
            lineno=with_line,
            hint="Bind the pipeline to a plain name: `with patchkit.capture() as pipeline:`.",
        )
    handler = own.target
    visited, exits = _explore(walker, store_at + 1, handler, with_line)
    if as_store.name != "POP_TOP":  # `return pipeline` after the block: the pipeline is no output
        as_name = name_of(as_store.arg)
        exits = {i: _Exit(x.kind, x.value, None) if _loads(x.then, as_name) else x for i, x in exits.items()}
    has_return = any(x.kind != "normal" for x in exits.values())
    body = explicit_super(_rewrite(elements, visited, exits, has_return, handler, with_line), code)
    _refuse_suspension(body, code)
    return CapturedBlock(
        scope="function" if code.co_flags & CO_OPTIMIZED else "module",
        filename=code.co_filename,
        code_name=code.co_name,
        with_lineno=with_line,
        first_lineno=code.co_firstlineno,
        body=tuple(body),
        has_return=has_return,
        body_offset=_body_offset(code, with_offset),
        code_flags=code.co_flags,
        nested_codes=tuple(e.arg for e in body if isinstance(e, Instr) and isinstance(e.arg, types.CodeType)),
    )


def _explore(walker: _Walker, start: int, handler: Label, with_line: int) -> tuple[set[int], dict[int, _Exit]]:
    """Elements reachable from `start` inside the block, and the exit sequences that end it."""
    elements = walker.elements
    visited: set[int] = set()
    exits: dict[int, _Exit] = {}
    memo: dict[int, bool] = {}
    todo = [start]
    while todo:
        i = todo.pop()
        if i in visited or i in exits or i >= len(elements):
            continue
        e = elements[i]
        if isinstance(e, Instr) and not walker.protected_by(i, handler, memo):
            found = walker.exit_at(i, with_line)
            if found is not None:
                exits[i] = found
                continue
        visited.add(i)
        todo.extend(_successors(walker, i, handler, memo))
    return visited, exits


def _successors(walker: _Walker, i: int, handler: Label, memo: dict[int, bool]) -> list[int]:
    e = walker.elements[i]
    if isinstance(e, TryBegin):
        return [i + 1, *_inner_handler(walker, e.target, handler, memo)]
    if not isinstance(e, Instr):
        return [i + 1]
    out = []
    if e.has_jump():
        out.append(walker.label_at[id(e.arg)])
    if not (e.is_uncond_jump() or e.is_final()):
        out.append(i + 1)
    return out


def _inner_handler(walker: _Walker, target: Label, handler: Label, memo: dict[int, bool]) -> list[int]:
    """[index of `target`] when it is the handler of a `try` or `with` inside the block, else [].

    The block's own handler and the handlers of statements around the block are outside it: an
    exception raised in them no longer reaches the block's own handler.
    """
    if target is handler:
        return []
    at = walker.label_at[id(target)]
    first = next((j for j, _ in walker.instrs_from(at)), None)
    return [at] if first is not None and walker.protected_by(first, handler, memo) else []


def _falls_through(e: Any) -> bool:
    return not isinstance(e, Instr) or not (e.is_uncond_jump() or e.is_final())


def _rewrite(
    elements: list[Any], visited: set[int], exits: dict[int, _Exit], has_return: bool, handler: Label, line: int
) -> list[Any]:
    """The visited elements in order, minus every try range whose handler is outside the block,
    with exits made returns.

    In a block that has `return`, a path that leaves it where the function returns at once
    (`return answer` right after the block, or the function's end) returns that, as in Python;
    any other way out is a `BlockExit`, which returns the block's output variable.

    A nested try range is closed even where its TryEnd follows a final instruction (a RERAISE)
    and so is never reached by control flow.
    """
    label_at = {id(e): i for i, e in enumerate(elements) if isinstance(e, Label)}
    body: list[Any] = []
    opened: set[int] = set()
    for i, e in enumerate(elements):
        if isinstance(e, TryEnd):
            keep = id(e.entry) in opened
        elif isinstance(e, TryBegin):
            keep = i in visited and e.target is not handler and label_at[id(e.target)] in visited
        else:
            keep = i in visited
        if keep:
            body.append(e)
            if isinstance(e, TryBegin):
                opened.add(id(e))
        if i in visited and _falls_through(e) and i + 1 not in visited:
            last = next((x for x in reversed(elements[: i + 1]) if isinstance(x, Instr) and x.lineno), None)
            body.extend(_epilogue(exits[i + 1], e, last, has_return, line))  # every way out of the body is an exit
    return body


def _epilogue(exit_: _Exit, before: Any, last: Instr | None, has_return: bool, line: int) -> list[Any]:
    location = getattr(before, "location", None) or getattr(last, "location", None)
    if exit_.kind == "value":
        return [Instr("RETURN_VALUE", location=location)]
    if exit_.kind == "const":
        return [Instr("LOAD_CONST", exit_.value, location=location), Instr("RETURN_VALUE", location=location)]
    if has_return and exit_.then is not None:
        return [e.copy() for e in exit_.then]
    return [SetLineno(line), BlockExit(line, last.lineno if last is not None else None)]


def _refuse_suspension(body: list[Any], code: types.CodeType) -> None:
    for e in body:
        if isinstance(e, Instr) and e.name in SUSPENDING:
            raise CaptureError(
                "`yield` or `await` inside the block",
                filename=code.co_filename,
                lineno=e.lineno,
                hint="A pipeline body runs to completion: call the async code from a component method instead.",
            )
