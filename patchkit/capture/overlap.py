"""Parallel calls, where the code must wait: a forward pass over a captured body's control flow.

A call of a `read_only=True` method whose result goes straight into a variable
(`docs = retriever.retrieve(q)`), into a comprehension's list (`[grader.grade(q, d) for d in docs]`) or
nowhere is *deferred*: deployed, the call hook submits it and hands back a `Pending`
(`capture/pending.py`), and the code goes on. A call of any other method keeps plain Python's place, as
`ordered=True` does: every open call is waited for before it is made, and it is waited for where it is made,
so what it writes every later call reads, and it is never made after an earlier call failed. The pass knows,
at each instruction, which variables may hold a Pending, which calls may be open and which stack items hold
Pendings, and so where the code must wait (`Actions`, written into the body by `parallel.py`):

- before a variable's first use, `v = resolve(v)` (the call's result, or the list with its results);
- before code that could have effects outside the block, or could see a Pending (a call of any other
  function, a store into an object, `return`, `raise`, a call that keeps its place, entering a `try`),
  `settle()` (every open call waited for in issue order, the earliest error raised) and every variable
  resolved. So a *window* stays open only over local work (loads, stores, arithmetic, string building,
  branches, loops over containers, builtins) and other read-only component calls;
- before local work that runs user code on some values (an operator's dunder, a truth test, a format, a
  property, a builtin's key function or generator), a `guard` that settles first unless the running values
  are plain data (`capture/guards.py`): so no user code runs while calls are open, and nothing changes an
  object an open call holds (`x += y` on a mutable `x` settles first), which is what keeps a call's
  arguments as they were when it was made;
- before a loop starts, `iterable(...)`: a generator's steps settle first, as they run the user's code;
- before a store to a variable that code handed to an open call may read when it runs (a cell a lambda,
  generator or inner function shares, a `nonlocal`, a `global`, a module-level name nested code reads),
  `settle()`: the call sees the value the variable had when it was made.

Calls inside a `try` body or handler are not deferred (a handler must see the variables as plain Python
leaves them), nor are calls whose result variable a lambda, generator or inner function reads, nor calls
no other call could overlap (waited for before another could start). Anything the pass cannot follow
keeps the call as it is, waited for where it is made. The pairs of calls that may be in flight together
make the graph's overlap groups.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from bytecode import Instr, Label, TryBegin, TryEnd

from patchkit.capture.analysis import successors
from patchkit.capture.compat import CALL_OPS, PY313, name_of
from patchkit.capture.guards import INPLACE_OPS, SHALLOW_OPS
from patchkit.capture.ir import BlockExit
from patchkit.capture.stack import pops_pushes

__all__ = ["COMPREHENSION", "EMPTY", "OUTER", "STORES", "Actions", "Guard", "OverlapPass", "SiteNode", "State",
           "is_comprehension", "reads_of"]

# A call instruction -> (its graph node, whether it keeps its place: its method is not read-only, or ordered)
SiteNode = Callable[[Instr], "tuple[str, bool] | None"]
EMPTY: frozenset[Any] = frozenset()
OUTER = ""  # in a comprehension's own code: calls of the code around it may be open

# What may run while calls are open: it has no effect outside the block and cannot see a Pending
# (variables are resolved before they are read). Everything else closes the window.
_SAFE = frozenset({
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
_READS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_NAME", "LOAD_DEREF"})
STORES = frozenset({"STORE_FAST", "STORE_NAME", "STORE_DEREF"})
_DELETES = frozenset({"DELETE_FAST", "DELETE_NAME", "DELETE_DEREF"})
_DEFER_INTO = STORES | {"LIST_APPEND", "POP_TOP"}
_MOVES = _DEFER_INTO | {"SWAP", "COPY"}  # what moves a Pending (or a list of them) without looking at it
# Builtins whose calls only compute from their arguments; called under their own name (not shadowed by a
# global or a variable of the block), they keep a window open as arithmetic does, behind a guard that
# their arguments are data and their key functions safe.
_PURE_BUILTINS = frozenset({"len", "str", "int", "float", "bool", "abs", "round", "isinstance", "range", "enumerate",
                            "zip", "list", "tuple", "dict", "set", "frozenset", "sum", "any", "all", "repr", "reversed",
                            "min", "max", "sorted"})
COMPREHENSION = "<listcomp>"  # 3.11 runs a list comprehension as its own code; 3.12+ inline it
# The window's instructions that may run user code, by the check (`capture/guards.py`) of their operands.
_CHECKED = {
    "COMPARE_OP": "deep", "CONTAINS_OP": "deep", "FORMAT_VALUE": "deep", "FORMAT_SIMPLE": "deep",
    "FORMAT_WITH_SPEC": "deep", "CONVERT_VALUE": "deep", "BUILD_SET": "deep", "SET_ADD": "deep", "MAP_ADD": "deep",
    "BUILD_MAP": "deep", "UNARY_NEGATIVE": "shallow", "UNARY_NOT": "shallow", "UNARY_INVERT": "shallow",
    "TO_BOOL": "shallow", "UNPACK_SEQUENCE": "shallow", "UNPACK_EX": "shallow", "LIST_EXTEND": "shallow",
    "BINARY_SLICE": "shallow", "BINARY_SUBSCR": "subscript", "LOAD_ATTR": "attribute", "LOAD_METHOD": "attribute",
}
# Nested code that reads variables by name at run time: any store of the block's names may reach it.
_REFLECTIVE = frozenset({"globals", "locals", "vars", "eval", "exec"})
_BOOLEANS = frozenset({"IS_OP", "CONTAINS_OP", "COMPARE_OP", "UNARY_NOT", "TO_BOOL"})  # on data: a bool
# Scalars the pass can follow: constants, fast locals bound to them, and what the operators below make of them
# (a bool, a number, a string: the interpreter's own types, whose operators and truth run no user code).
_SCALAR_CONSTS = (int, float, complex, bool, str, bytes, type(None))
_SCALAR_OPS = frozenset({"BINARY_OP", "COMPARE_OP", "UNARY_NEGATIVE", "UNARY_NOT", "UNARY_INVERT", "TO_BOOL"})
_FAST_LOADS = frozenset({"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR"})
_TRUTH_TESTS = frozenset({"POP_JUMP_IF_TRUE", "POP_JUMP_IF_FALSE", "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_FORWARD_IF_FALSE",
                          "POP_JUMP_BACKWARD_IF_TRUE", "POP_JUMP_BACKWARD_IF_FALSE", "JUMP_IF_TRUE_OR_POP",
                          "JUMP_IF_FALSE_OR_POP"})
_TESTS = _TRUTH_TESTS | {"TO_BOOL", "UNARY_NOT"}


@dataclass(frozen=True)
class _Slot:
    """A stack item as the pass sees it: the deferred calls whose Pendings it is or holds, and the
    comprehension code it is the function of (3.11)."""

    calls: frozenset[int] = EMPTY
    comprehension: types.CodeType | None = None
    pure: bool = False  # a builtin function that only computes (`len`, `str`, `sorted`, ...)
    holder: bool = False  # a list holding Pendings (else, with calls, a Pending itself)
    boolean: bool = False  # a test's result, guarded on its operands: its truth runs no code of the user's
    scalar: bool = False  # a builtin scalar for sure (`_SCALAR_CONSTS`): what it takes part in needs no guard

    def join(self, other: _Slot) -> _Slot:
        same = self.comprehension is other.comprehension
        return _Slot(self.calls | other.calls, self.comprehension if same else None, self.pure and other.pure,
                     self.holder or other.holder, self.boolean and other.boolean, self.scalar and other.scalar)


_PLAIN = _Slot()


@dataclass(frozen=True)
class State:
    pending: frozenset[str]  # variables that may hold a Pending, or a list with Pendings
    bound: frozenset[str]  # variables bound on every path here
    open: frozenset[str]  # graph nodes of deferred calls that may be open (OUTER: the enclosing code's)
    stack: tuple[_Slot, ...]
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


class _Demote(Exception):
    """A Pending would reach code the pass cannot rewrite: these calls are waited for where they are made."""

    def __init__(self, calls: frozenset[int]) -> None:
        self.calls = calls


class OverlapPass:
    """The rewrite of one instruction list: the captured body, or a 3.11 list comprehension's code."""

    def __init__(self, body: list[Any], site_node: SiteNode, entry: State,
                 output: str | None, nested_reads: frozenset[str], shadowed: frozenset[str], *,
                 comprehensions: bool) -> None:
        self.body, self.site_node, self.entry, self.output = body, site_node, entry, output
        self.comprehensions = comprehensions  # 3.11 list comprehensions called here are rewritten too
        self.succ = successors(tuple(body))
        self.label_at = {id(e): i for i, e in enumerate(body) if isinstance(e, Label)}
        self.guarded = _guarded(body, self.label_at)
        self.nested_reads = nested_reads
        self.reflective = bool(nested_reads & _REFLECTIVE)
        self.store_ops: dict[str, Instr] = {}
        for e in body:
            if isinstance(e, Instr) and e.name in STORES:
                self.store_ops.setdefault(name_of(e.arg), e)
        stored = {name_of(e.arg) for e in body if isinstance(e, Instr) and e.name in STORES | {"STORE_GLOBAL"}}
        self.pure_builtins = _PURE_BUILTINS - stored - shadowed
        self.demoted: set[int] = set()
        self._kinds: dict[int, str | None] = {}
        self.pairs: set[tuple[str, str]] = set()
        self.comprehension_open: dict[int, frozenset[str]] = {}  # id(code) -> calls open when it is called

    # -- which calls ---------------------------------------------------------------------------------
    def kind(self, i: int) -> str | None:
        """"deferred", "call" (a component call waited for in place), "ordered", or None (not a component's)."""
        if i not in self._kinds:
            self._kinds[i] = self._kind(i)
        return self._kinds[i]

    def _kind(self, i: int) -> str | None:
        e = self.body[i]
        found = self.site_node(e)
        if found is None:
            return None
        _, ordered = found
        if ordered:
            return "ordered"
        nxt = self.body[i + 1] if i + 1 < len(self.body) else None
        if not isinstance(nxt, Instr) or nxt.name not in _DEFER_INTO or self.guarded[i] or i in self.demoted:
            return "call"
        if nxt.name in STORES and (name_of(nxt.arg) in self.nested_reads or self.late_read(nxt)):
            return "call"
        return "deferred"

    # -- the forward pass ----------------------------------------------------------------------------
    def run(self) -> tuple[list[State | None], list[Actions]]:
        """The states and waits at each element, once every deferred call can overlap with another: one
        waited for before any other call could start is made where it is, as plain Python makes it."""
        while True:
            try:
                states, actions = self._fixpoint()
            except _Demote as demote:
                self._demote(demote.calls)
                continue
            overlapping = {node for pair in self.pairs for node in pair}
            alone = {i for i, s in enumerate(states) if s is not None and self.kind(i) == "deferred"
                     and self.node_of(i) not in overlapping}
            if not alone:
                return states, actions
            self._demote(frozenset(alone))

    def _demote(self, calls: frozenset[int]) -> None:
        self.demoted |= calls
        self._kinds.clear()
        self.pairs.clear()

    def _fixpoint(self) -> tuple[list[State | None], list[Actions]]:
        states: list[State | None] = [None] * len(self.body)
        states[0] = self.entry
        todo = [0]
        while todo:
            i = todo.pop()
            state = states[i]
            assert state is not None
            for j, out in self._step(i, state)[1]:
                old = states[j]
                new = out if old is None else old.join(out)
                if new != old:
                    states[j] = new
                    todo.append(j)
        actions = [self._step(i, s)[0] if s is not None else Actions() for i, s in enumerate(states)]
        return states, actions

    def _step(self, i: int, state: State) -> tuple[Actions, list[tuple[int, State]]]:
        e = self.body[i]
        acts = Actions()
        if isinstance(e, BlockExit):
            self._close(acts, state, extra=(self.output,) if self.output in state.pending else ())
            return acts, []
        if isinstance(e, TryBegin):
            if self.guarded[i]:
                state = self._close(acts, state)
            depth = e.stack_depth if isinstance(e.stack_depth, int) else len(state.stack)
            kept = (_PLAIN,) * max(0, depth - len(state.stack)) + state.stack[:depth]
            handler = replace(state, stack=kept + (_PLAIN,) * (1 + int(e.push_lasti)))
            return acts, [(i + 1, state), (self.label_at[id(e.target)], handler)]
        if not isinstance(e, Instr):
            return acts, [(j, state) for j in self.succ[i]]
        state = self._before(i, e, state, acts)
        if e.has_jump() and not e.is_uncond_jump():
            target = self.label_at[id(e.arg)]
            return acts, [(j, self._effect(i, e, state, jump)) for j, jump in ((target, True), (i + 1, False))
                          if j < len(self.body)]
        after = self._effect(i, e, state, False)
        return acts, [(j, after) for j in self.succ[i]]

    def _before(self, i: int, e: Instr, state: State, acts: Actions) -> State:
        """The waits `e` needs before it runs, added to `acts`; the state they leave."""
        if self._loop_exit(i):
            return state
        kind = self.kind(i) if e.name in CALL_OPS else None
        if kind in ("deferred", "call"):
            self._overlaps(e, state)
        pops = pops_pushes(e)[0]
        popped = state.stack[len(state.stack) - pops:] if pops else ()
        comprehension = next((s.comprehension for s in popped if s.comprehension is not None), None)
        if e.name in CALL_OPS and comprehension is not None and not self.guarded[i]:
            self.comprehension_open[id(comprehension)] = state.open
            self.pairs.update((node, COMPREHENSION) for node in state.open if node != OUTER)  # its calls overlap them
            return self._resolve(acts, state, sorted(reads_of(comprehension) & state.pending))
        pure = e.name in CALL_OPS and any(s.pure for s in popped[:2])
        unsafe = self.guarded[i] or self.late_read(e) or (e.name not in _SAFE and kind not in ("deferred", "call")
                                                           and not pure)
        if unsafe:
            state = self._close(acts, state)
        reads = [name_of(e.arg)] if e.name in _READS else []
        state = self._resolve(acts, state, [v for v in reads if v in state.pending])
        if unsafe:
            return state
        if e.name == "GET_ITER":
            acts.iterate_top = True
        moves = e.name in _MOVES and not (e.name == "LIST_APPEND" and popped[-1].holder)  # lists of lists: one level
        state = state if moves else self._resolve_top(acts, state, popped)
        plain = (e.name in _TESTS and popped[-1].boolean) or (e.name in _SCALAR_OPS and all(s.scalar for s in popped))
        if state.open and not plain:
            acts.guard = _guard(e, popped) if not pure else _call_guard(popped)
        return state

    def late_read(self, e: Instr) -> bool:
        """Whether `e` stores a variable that code handed to an open call may read as it runs (a cell, a name
        nested code reads as a global): the calls are waited for first, and see the value it had when made."""
        return e.name == "STORE_DEREF" or (
            e.name == "STORE_NAME" and (self.reflective or name_of(e.arg) in self.nested_reads))

    def _loop_exit(self, i: int) -> bool:
        """An instruction an ended loop jumps past (3.12's END_FOR, and 3.13's POP_TOP after it): nothing may
        go before it."""
        e, before = self.body[i], self.body[i - 1] if i else None
        after_end = PY313 and isinstance(before, Instr) and before.name == "END_FOR"
        return isinstance(e, Instr) and (e.name == "END_FOR" or after_end)

    def _close(self, acts: Actions, state: State, extra: Iterable[str | None] = ()) -> State:
        """Close the window: settle, then resolve every variable that may hold a Pending and is bound."""
        if not (state.open or state.pending or any(s.calls for s in state.stack)):
            return state
        acts.settle = True
        names = sorted((state.pending & state.bound) | {v for v in extra if v is not None})
        state = self._resolve(acts, self._resolve_top(acts, state, state.stack), names)
        return replace(state, open=EMPTY)

    def _resolve(self, acts: Actions, state: State, names: list[str]) -> State:
        acts.resolve += [v for v in names if v not in acts.resolve]
        return state.release(names, self.node_of)

    def _resolve_top(self, acts: Actions, state: State, slots: tuple[_Slot, ...]) -> State:
        """The Pendings held in `slots` (the top of the stack) resolved: at its very top, where a wait can
        reach them; deeper, the calls that made them are waited for where they are made instead."""
        tagged = [k for k, s in enumerate(slots) if s.calls]
        if not tagged:
            return state
        if tagged != [len(slots) - 1]:
            raise _Demote(frozenset().union(*(slots[k].calls for k in tagged)))
        acts.resolve_top = True
        return replace(state, stack=state.stack[:-1] + (_PLAIN,))

    def node_of(self, i: int) -> str:
        found = self.site_node(self.body[i])
        assert found is not None
        return found[0]

    def _overlaps(self, e: Instr, state: State) -> None:
        found = self.site_node(e)
        assert found is not None
        node = found[0]
        self.pairs.update((node, other) for other in state.open if other != OUTER)

    def _effect(self, i: int, e: Instr, state: State, jump: bool) -> State:
        """The state after `e` runs (after its waits)."""
        name = e.name
        reach = int(e.arg) if name in ("SWAP", "COPY", "LIST_APPEND") else pops_pushes(e, jump)[0]
        stack = [_PLAIN] * max(0, reach + 1 - len(state.stack)) + list(state.stack)  # never short of what it reads
        if name in STORES or name in _DELETES:
            var = name_of(e.arg)
            top = stack.pop() if name in STORES else _PLAIN
            pending = state.pending | {var} if top.calls else state.pending - {var}
            bound = state.bound | {var} if name in STORES else state.bound - {var}
            holds = frozenset(h for h in state.holds if h[0] != var) | {(var, self.node_of(c)) for c in top.calls}
            scalars = state.scalars | {var} if name == "STORE_FAST" and top.scalar else state.scalars - {var}
            return replace(state, pending=pending, bound=bound, stack=tuple(stack), holds=holds, scalars=scalars)
        if name == "SWAP":
            n = int(e.arg)
            stack[-1], stack[-n] = stack[-n], stack[-1]
            return replace(state, stack=tuple(stack))
        if name == "COPY":
            stack.append(stack[-int(e.arg)])
            return replace(state, stack=tuple(stack))
        if name == "LIST_APPEND":
            item = stack.pop()
            k = len(stack) - int(e.arg)
            stack[k] = _Slot(stack[k].calls | item.calls, stack[k].comprehension, holder=stack[k].holder or bool(item.calls))
            return replace(state, stack=tuple(stack))
        pops, pushes = pops_pushes(e, jump)
        popped = stack[len(stack) - pops:] if pops else []
        del stack[len(stack) - len(popped):]
        if name in CALL_OPS and self.kind(i) == "deferred":
            stack.append(_Slot(frozenset({i})))
            node = self.site_node(e)
            assert node is not None
            return replace(state, open=state.open | {node[0]}, stack=tuple(stack))
        code = e.arg if name == "LOAD_CONST" and self.comprehensions and is_comprehension(e.arg) else None
        if name in ("MAKE_FUNCTION", "SET_FUNCTION_ATTRIBUTE"):
            code = next((s.comprehension for s in popped if s.comprehension is not None), None)
        pure = name in ("LOAD_GLOBAL", "LOAD_NAME") and name_of(e.arg) in self.pure_builtins
        scalar = (name in _FAST_LOADS and name_of(e.arg) in state.scalars) or name == "BUILD_STRING" \
            or (name == "LOAD_CONST" and type(e.arg) in _SCALAR_CONSTS) or name in ("IS_OP", "CONTAINS_OP") \
            or (name in _SCALAR_OPS and all(s.scalar for s in popped))
        top = _Slot(comprehension=code, pure=pure, boolean=name in _BOOLEANS, scalar=scalar)
        stack += [_PLAIN] * (pushes - 1) + [top] if pushes else []
        if name == "LOAD_FAST_AND_CLEAR":
            state = replace(state, scalars=state.scalars - {name_of(e.arg)})
        return replace(state, stack=tuple(stack))


def _guard(e: Instr, popped: tuple[_Slot, ...]) -> Guard | None:
    """The check `e` needs while calls may be open, or None where it runs no code of the user's."""
    if e.name == "BINARY_OP":
        op = int(e.arg)
        if op in INPLACE_OPS:
            return Guard("inplace", (2, 1), (op,))
        return Guard("shallow" if op in SHALLOW_OPS else "deep", (2, 1))
    kind = "shallow" if e.name in _TRUTH_TESTS else _CHECKED.get(e.name)
    if kind is None:
        return None
    if kind == "attribute":
        return Guard(kind, (1,), (name_of(e.arg),))
    n = 1 if e.name in _TRUTH_TESTS or e.name in ("SET_ADD", "LIST_EXTEND") else len(popped)
    return Guard(kind, tuple(range(n, 0, -1))) if n else None


def _call_guard(popped: tuple[_Slot, ...]) -> Guard:
    """A builtin's call: the function (never the NULL beside it: below it before 3.13, above it since) and
    every argument above them."""
    n = len(popped)
    return Guard("call", (n if PY313 else n - 1, *range(n - 2, 0, -1)))


def _guarded(body: list[Any], label_at: dict[int, int]) -> list[bool]:
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
