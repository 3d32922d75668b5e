"""What the overlap pass (`overlap.py`) knows and decides, apart from the pass itself.

The instructions a window may hold while calls are open, and those that settle or need a guard; the
pass's state at an instruction (`State`: which variables and stack items may hold a Pending, which calls
may be open); and what it writes before an element (`Actions`: a settle, variables resolved, a `Guard` of
the operands, checked at run time by `capture/guards.py`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from bytecode import Instr, TryBegin, TryEnd

from patchkit.capture.compat import PY313, name_of
from patchkit.capture.guards import INPLACE_OPS, SHALLOW_OPS

__all__ = ["COMPREHENSION", "EMPTY", "OUTER", "PLAIN", "STORES", "Actions", "Demote", "Guard", "SiteNode", "Slot", "State",
           "call_guard_of", "guard_of", "in_user_try", "is_comprehension", "reads_of"]

# A call instruction -> (its graph node, whether it keeps its place: its method is not read-only, or ordered)
SiteNode = Callable[[Instr], "tuple[str, bool] | None"]
EMPTY: frozenset[Any] = frozenset()
OUTER = ""  # in a comprehension's own code: calls of the code around it may be open

# What may run while calls are open: it has no effect outside the block and cannot see a Pending
# (variables are resolved before they are read). Everything else closes the window.
SAFE = frozenset({
    "NOP", "RESUME", "CACHE", "PRECALL", "KW_NAMES", "PUSH_NULL", "POP_TOP", "COPY", "SWAP", "MAKE_CELL",
    "COPY_FREE_VARS", "LOAD_CONST", "LOAD_SMALL_INT", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR",
    "LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLOSURE", "STORE_FAST", "STORE_NAME",
    "LOAD_ATTR", "LOAD_METHOD", "BUILD_LIST", "BUILD_TUPLE", "BUILD_MAP", "BUILD_CONST_KEY_MAP", "BUILD_SET",
    "BUILD_STRING", "BUILD_SLICE", "LIST_APPEND", "LIST_EXTEND", "SET_ADD", "MAP_ADD", "LIST_TO_TUPLE",
    "BINARY_OP", "COMPARE_OP", "IS_OP", "CONTAINS_OP", "UNARY_NEGATIVE", "UNARY_NOT", "UNARY_INVERT", "TO_BOOL",
    "BINARY_SUBSCR", "BINARY_SLICE", "FORMAT_VALUE", "FORMAT_SIMPLE", "FORMAT_WITH_SPEC", "CONVERT_VALUE",
    "UNPACK_SEQUENCE", "UNPACK_EX", "GET_ITER", "FOR_ITER", "END_FOR", "POP_ITER", "MAKE_FUNCTION",
    "SET_FUNCTION_ATTRIBUTE", "JUMP_FORWARD", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT", "JUMP",
    "JUMP_NO_INTERRUPT", "POP_JUMP_IF_TRUE", "POP_JUMP_IF_FALSE", "POP_JUMP_IF_NONE", "POP_JUMP_IF_NOT_NONE",
    "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_FORWARD_IF_FALSE", "POP_JUMP_BACKWARD_IF_TRUE",
    "POP_JUMP_BACKWARD_IF_FALSE", "POP_JUMP_FORWARD_IF_NONE", "POP_JUMP_FORWARD_IF_NOT_NONE",
    "POP_JUMP_BACKWARD_IF_NONE", "POP_JUMP_BACKWARD_IF_NOT_NONE", "JUMP_IF_TRUE_OR_POP", "JUMP_IF_FALSE_OR_POP",
    "RERAISE",  # an error on its way out (of an inlined comprehension): the runner puts the earliest call's first
})
READS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_NAME", "LOAD_DEREF"})
STORES = frozenset({"STORE_FAST", "STORE_NAME", "STORE_DEREF"})
DELETES = frozenset({"DELETE_FAST", "DELETE_NAME", "DELETE_DEREF"})
DEFER_INTO = STORES | {"LIST_APPEND", "POP_TOP"}
MOVES = DEFER_INTO | {"SWAP", "COPY"}  # what moves a Pending (or a list of them) without looking at it
# Builtins whose calls only compute from their arguments; called under their own name (not shadowed by a
# global or a variable of the block), they keep a window open as arithmetic does, behind a guard that
# their arguments are data and their key functions safe.
PURE_BUILTINS = frozenset({"len", "str", "int", "float", "bool", "abs", "round", "isinstance", "range", "enumerate",
                            "zip", "list", "tuple", "dict", "set", "frozenset", "sum", "any", "all", "repr", "reversed",
                            "min", "max", "sorted"})
COMPREHENSION = "<listcomp>"  # 3.11 runs a list comprehension as its own code; 3.12+ inline it
# The window's instructions that may run user code, by the check (`capture/guards.py`) of their operands.
CHECKED = {
    "COMPARE_OP": "deep", "CONTAINS_OP": "deep", "FORMAT_VALUE": "deep", "FORMAT_SIMPLE": "deep",
    "FORMAT_WITH_SPEC": "deep", "CONVERT_VALUE": "deep", "BUILD_SET": "deep", "SET_ADD": "deep", "MAP_ADD": "deep",
    "BUILD_MAP": "deep", "UNARY_NEGATIVE": "shallow", "UNARY_NOT": "shallow", "UNARY_INVERT": "shallow",
    "TO_BOOL": "shallow", "UNPACK_SEQUENCE": "shallow", "UNPACK_EX": "shallow", "LIST_EXTEND": "shallow",
    "BINARY_SLICE": "shallow", "BINARY_SUBSCR": "subscript", "LOAD_ATTR": "attribute", "LOAD_METHOD": "attribute",
}
# Nested code that reads variables by name at run time: any store of the block's names may reach it.
REFLECTIVE = frozenset({"globals", "locals", "vars", "eval", "exec"})
BOOLEANS = frozenset({"IS_OP", "CONTAINS_OP", "COMPARE_OP", "UNARY_NOT", "TO_BOOL"})  # on data: a bool
# Scalars the pass can follow: constants, fast locals bound to them, and what the operators below make of them
# (a bool, a number, a string: the interpreter's own types, whose operators and truth run no user code).
SCALAR_CONSTS = (int, float, complex, bool, str, bytes, type(None))
SCALAR_OPS = frozenset({"BINARY_OP", "COMPARE_OP", "UNARY_NEGATIVE", "UNARY_NOT", "UNARY_INVERT", "TO_BOOL"})
FAST_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR"})
TRUTH_TESTS = frozenset({"POP_JUMP_IF_TRUE", "POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_FORWARD_IF_FALSE",
                          "POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE", "JUMP_IF_TRUE_OR_POP",
                          "JUMP_IF_FALSE_OR_POP"})
TESTS = TRUTH_TESTS | {"TO_BOOL", "UNARY_NOT"}


@dataclass(frozen=True)
class Slot:
    """A stack item as the pass sees it: the deferred calls whose Pendings it is or holds, and the
    comprehension code it is the function of (3.11)."""

    calls: frozenset[int] = EMPTY
    comprehension: types.CodeType | None = None
    pure: bool = False  # a builtin function that only computes (`len`, `str`, `sorted`, ...)
    holder: bool = False  # a list holding Pendings (else, with calls, a Pending itself)
    boolean: bool = False  # a test's result, guarded on its operands: its truth runs no code of the user's
    scalar: bool = False  # a builtin scalar for sure (`SCALAR_CONSTS`): what it takes part in needs no guard

    def join(self, other: Slot) -> Slot:
        same = self.comprehension is other.comprehension
        return Slot(self.calls | other.calls, self.comprehension if same else None, self.pure and other.pure,
                     self.holder or other.holder, self.boolean and other.boolean, self.scalar and other.scalar)


PLAIN = Slot()


@dataclass(frozen=True)
class State:
    pending: frozenset[str]  # variables that may hold a Pending, or a list with Pendings
    bound: frozenset[str]  # variables bound on every path here
    open: frozenset[str]  # graph nodes of deferred calls that may be open (OUTER: the enclosing code's)
    stack: tuple[Slot, ...]
    holds: frozenset[tuple[str, str]] = EMPTY  # (variable, graph node of the deferred call whose Pending it may hold)
    scalars: frozenset[str] = EMPTY  # fast locals that hold a builtin scalar on every path here

    def join(self, other: State) -> State:
        stack = tuple(a.join(b) for a, b in zip(self.stack, other.stack))
        return State(self.pending | other.pending, self.bound & other.bound, self.open | other.open, stack,
                     self.holds | other.holds, self.scalars & other.scalars)

    def release(self, names: Iterable[str], node_of: Callable[[int], str]) -> State:
        """`names` resolved: they hold no Pending, and the calls no variable or stack item holds any more are no
        longer open (waited for, as far as the overlap groups go)."""
        gone = set(names)
        holds = frozenset(h for h in self.holds if h[0] not in gone)
        still = {node for _, node in holds} | {node_of(i) for slot in self.stack for i in slot.calls}
        released = {node for var, node in self.holds if var in gone} - still
        return replace(self, pending=self.pending - gone, holds=holds, open=self.open - released)


@dataclass(frozen=True)
class Guard:
    """A check of the operands an instruction is about to use: `kind` names it in `capture/guards.py`;
    `depths` are the operands' places on the stack (1 its top), in the order the check takes them; `extra`
    constants follow them (an attribute's name, an operator's number)."""

    kind: str
    depths: tuple[int, ...]
    extra: tuple[Any, ...] = ()


@dataclass
class Actions:
    """What goes before one element: a settle, variables resolved, the top of the stack resolved or
    made a loop's `iterable`, then a guard of what it uses."""

    settle: bool = False
    resolve: list[str] = field(default_factory=list)
    resolve_top: bool = False
    iterate_top: bool = False
    guard: Guard | None = None


class Demote(Exception):
    """A Pending would reach code the pass cannot rewrite: these calls are waited for where they are made."""

    def __init__(self, calls: frozenset[int]) -> None:
        self.calls = calls


def guard_of(e: Instr, popped: tuple[Slot, ...]) -> Guard | None:
    """The check `e` needs while calls may be open, or None where it runs no code of the user's."""
    if e.name == "BINARY_OP":
        op = int(e.arg)
        if op in INPLACE_OPS:
            return Guard("inplace", (2, 1), (op,))
        return Guard("shallow" if op in SHALLOW_OPS else "deep", (2, 1))
    kind = "shallow" if e.name in TRUTH_TESTS else CHECKED.get(e.name)
    if kind is None:
        return None
    if kind == "attribute":
        return Guard(kind, (1,), (name_of(e.arg),))
    n = 1 if e.name in TRUTH_TESTS or e.name in ("SET_ADD", "LIST_EXTEND") else len(popped)
    return Guard(kind, tuple(range(n, 0, -1))) if n else None


def call_guard_of(popped: tuple[Slot, ...]) -> Guard:
    """A builtin's call: the function (never the NULL beside it: below it before 3.13, above it since) and
    every argument above them."""
    n = len(popped)
    return Guard("call", (n if PY313 else n - 1, *range(n - 2, 0, -1)))


def in_user_try(body: list[Any], label_at: dict[int, int]) -> list[bool]:
    """For each element, whether it lies in a `try` region whose handler is the user's (not the
    compiler's cleanup of an inlined comprehension, which only restores a variable and re-raises)."""
    out, inside = [], False
    for e in body:
        if isinstance(e, TryBegin):
            inside = not _cleanup_only(body, label_at[id(e.target)])
        elif isinstance(e, TryEnd):
            inside = False
        out.append(inside)
    return out


def _cleanup_only(body: list[Any], start: int) -> bool:
    for e in body[start + 1:]:
        if isinstance(e, Instr):
            if e.name == "RERAISE":
                return True
            if e.name not in ("SWAP", "POP_TOP", "STORE_FAST", "NOP"):
                return False
    return False


def is_comprehension(obj: Any) -> bool:
    return isinstance(obj, types.CodeType) and obj.co_name == COMPREHENSION


def reads_of(code: types.CodeType) -> frozenset[str]:
    """Variables of the enclosing code that nested code reads: its free variables and globals, recursively."""
    found = set(code.co_freevars) | set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= reads_of(const)
    return frozenset(found)
