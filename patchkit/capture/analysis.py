"""Pure passes over a `CapturedBlock`: which names it reads before writing, and its default output;
and the control-flow helpers the data-flow pass builds on (successors, reachability).

Liveness runs on the body's instruction list: a name is live on entry when some path reads it
before any write. Those names, when bound at capture time, become the pipeline's inputs.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from typing import Any

from bytecode import Bytecode, Instr, Label, TryBegin

from patchkit.capture.compat import NAME_DELETES, NAME_STORES, name_of
from patchkit.capture.ir import BlockExit, CapturedBlock

__all__ = ["default_output", "global_reads", "live_in", "reachable", "successors"]

_READS = frozenset({"LOAD_NAME", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_CLOSURE"})


def instr_reads(e: Instr, scope: str) -> tuple[str, ...]:
    """Variables an instruction reads, in the scope's own namespace (globals count at module level)."""
    if e.name in _READS or (e.name == "LOAD_GLOBAL" and scope == "module"):
        return (name_of(e.arg),)
    if e.name == "LOAD_FAST_LOAD_FAST":  # 3.13 superinstruction
        return tuple(e.arg)
    if e.name == "STORE_FAST_LOAD_FAST":
        return (e.arg[1],)
    if e.name == "LOAD_CONST" and isinstance(e.arg, types.CodeType) and scope == "module":
        return tuple(global_reads(e.arg))
    return ()


def instr_writes(e: Instr) -> tuple[str, ...]:
    """Variables an instruction binds or unbinds."""
    if e.name in NAME_STORES or e.name in NAME_DELETES:
        return (name_of(e.arg),)
    if e.name == "STORE_FAST_STORE_FAST":
        return tuple(e.arg)
    if e.name == "STORE_FAST_LOAD_FAST":
        return (e.arg[0],)
    return ()


def global_reads(code: types.CodeType) -> set[str]:
    """Names a nested code object (comprehension, lambda, def) reads from its globals, recursively."""
    found: set[str] = set()
    for e in Bytecode.from_code(code):
        if isinstance(e, Instr):
            if e.name in ("LOAD_GLOBAL", "LOAD_NAME"):
                found.add(name_of(e.arg))
            elif isinstance(e.arg, types.CodeType):
                found |= global_reads(e.arg)
    return found


def successors(body: tuple[Any, ...]) -> list[list[int]]:
    """Successor indexes of every element of a body, exception handlers included."""
    label_at = {id(e): i for i, e in enumerate(body) if isinstance(e, Label)}
    out: list[list[int]] = []
    for i, e in enumerate(body):
        nxt: list[int] = []
        if isinstance(e, TryBegin):
            nxt = [i + 1, label_at[id(e.target)]]
        elif isinstance(e, BlockExit):
            nxt = []
        elif isinstance(e, Instr):
            if e.has_jump():
                nxt.append(label_at[id(e.arg)])
            if not (e.is_uncond_jump() or e.is_final()):
                nxt.append(i + 1)
        else:
            nxt = [i + 1]
        out.append([j for j in nxt if j < len(body)])
    return out


def reachable(starts: Iterable[int], step: Callable[[int], Iterable[int]]) -> set[int]:
    """Every element reachable from `starts` by repeated `step`, the starts included.

    `step` gives an element's neighbours: successors for a forward walk, predecessors for a
    backward one; an element it gives nothing for ends the walk there.
    """
    seen = set(starts)
    todo = list(seen)
    while todo:
        for j in step(todo.pop()):
            if j not in seen:
                seen.add(j)
                todo.append(j)
    return seen


def live_in(block: CapturedBlock, output: str | None) -> frozenset[str]:
    """Names some path through the body reads before writing; `output` is read at every BlockExit."""
    body = block.body
    succ = successors(body)
    uses: list[tuple[str, ...]] = []
    defs: list[tuple[str, ...]] = []
    for e in body:
        if isinstance(e, Instr):
            uses.append(instr_reads(e, block.scope))
            defs.append(instr_writes(e))
        elif isinstance(e, BlockExit) and output is not None:
            uses.append((output,))
            defs.append(())
        else:
            uses.append(())
            defs.append(())
    live: list[frozenset[str]] = [frozenset()] * len(body)
    changed = True
    while changed:
        changed = False
        for i in reversed(range(len(body))):
            out = frozenset().union(*(live[j] for j in succ[i])) if succ[i] else frozenset()
            new = frozenset(uses[i]) | (out - frozenset(defs[i]))
            if new != live[i]:
                live[i] = new
                changed = True
    return live[0] if body else frozenset()


def default_output(block: CapturedBlock) -> str | None:
    """The name the block assigns last in its text: the output when `capture(output=...)` is left out.

    Names a comprehension or an `except ... as e` clause binds only for itself are skipped.
    """
    scratch = set(_scratch_names(block.body))
    last: tuple[tuple[int, int], str] | None = None
    for e in block.body:
        if isinstance(e, Instr) and e.name in NAME_STORES:
            name = name_of(e.arg)
            where = (e.location.lineno or 0, e.location.col_offset or 0) if e.location else (0, 0)
            if name not in scratch and (last is None or where >= last[0]):
                last = (where, name)
    return last[1] if last else None


def _scratch_names(body: Iterable[Any]) -> Iterable[str]:
    for e in body:
        if isinstance(e, Instr) and e.name in ("LOAD_FAST_AND_CLEAR", *NAME_DELETES):
            yield name_of(e.arg)
