"""Parallel calls: the captured body rewritten so that a request's independent component calls overlap.

A component call whose result goes straight into a variable (`docs = retriever.retrieve(q)`), into a
comprehension's list (`[grader.grade(q, d) for d in docs]`) or nowhere is *deferred*: deployed, the call
hook submits it and hands back a `Pending` (`component/pending.py`), and the code goes on. The rewrite
places the waits, from a forward pass over the body's control flow that knows, at each instruction, which
variables may hold a Pending, which calls may be open and which stack items hold Pendings:

- before a variable's first use, `v = resolve(v)` (the call's result, or the list with its results);
- before code that could have effects outside the block, or could see a Pending (a call of any other
  function, a store into an object, `return`, `raise`, an `ordered=True` method, entering a `try`),
  `settle()` (every open call waited for in issue order, the earliest error raised) and every variable
  resolved. So a *window* stays open only over local work (loads, stores, arithmetic, string building,
  branches, loops over containers) and other component calls, whose results are component calls' too;
- before a loop starts, `iterable(...)`: a generator's steps settle first, as they run the user's code.

Calls inside a `try` body or handler are not deferred (a handler must see the variables as plain Python
leaves them), nor are calls whose result variable a lambda, generator or inner function reads. Anything
the pass cannot follow keeps the call as it is, waited for where it is made. The eager pipeline runs
the original body; this one is only deployed (`Pipeline.run(..., parallel=True)`).
`rewrite` is called once per capture by `client/capture.py`.
"""

from __future__ import annotations

import dis
import types
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from bytecode import Bytecode, Instr, Label, TryBegin, TryEnd

from patchkit.capture.analysis import successors
from patchkit.capture.assemble import Program, assemble
from patchkit.capture.compat import CALL_OPS, PY312, PY313, name_of
from patchkit.capture.graph import Graph
from patchkit.capture.ir import BlockExit, CapturedBlock
from patchkit.capture.stack import pops_pushes
from patchkit.component import CallSite, make_methods
from patchkit.component.pending import RUNTIME_NAMES

__all__ = ["ParallelBody", "parallel_program", "rewrite"]

EMPTY: frozenset[Any] = frozenset()
OUTER = ""  # in a comprehension's own code: calls of the code around it may be open

# What may run while calls are open: it has no effect outside the block and cannot see a Pending
# (variables are resolved before they are read). Everything else closes the window.
_SAFE = frozenset({
    "NOP", "RESUME", "CACHE", "PRECALL", "KW_NAMES", "PUSH_NULL", "POP_TOP", "COPY", "SWAP", "MAKE_CELL",
    "COPY_FREE_VARS", "LOAD_CONST", "LOAD_SMALL_INT", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR",
    "LOAD_NAME", "LOAD_GLOBAL", "LOAD_DEREF", "LOAD_CLOSURE", "STORE_FAST", "STORE_NAME", "STORE_DEREF",
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
_STORES = frozenset({"STORE_FAST", "STORE_NAME", "STORE_DEREF"})
_DELETES = frozenset({"DELETE_FAST", "DELETE_NAME", "DELETE_DEREF"})
_DEFER_INTO = _STORES | {"LIST_APPEND", "POP_TOP"}
_MOVES = _DEFER_INTO | {"SWAP", "COPY"}  # what moves a Pending (or a list of them) without looking at it
_LOAD_OF = {"STORE_FAST": "LOAD_FAST_CHECK" if PY312 else "LOAD_FAST", "STORE_NAME": "LOAD_NAME",
            "STORE_DEREF": "LOAD_DEREF"}
_SPLIT = {"LOAD_FAST_LOAD_FAST": ("LOAD_FAST", "LOAD_FAST"), "STORE_FAST_LOAD_FAST": ("STORE_FAST", "LOAD_FAST"),
          "STORE_FAST_STORE_FAST": ("STORE_FAST", "STORE_FAST")}
# Builtins whose calls only compute from their arguments; called under their own name (not shadowed by a
# global or a variable of the block), they keep a window open as arithmetic does.
_PURE_BUILTINS = frozenset({"len", "str", "int", "float", "bool", "abs", "round", "isinstance", "range", "enumerate",
                            "zip", "list", "tuple", "dict", "set", "frozenset", "sum", "any", "all", "repr", "reversed",
                            "min", "max", "sorted"})
_COMPREHENSION = "<listcomp>"  # 3.11 runs a list comprehension as its own code; 3.12+ inline it


@dataclass(frozen=True)
class ParallelBody:
    """The rewritten body, and what the program made from it needs: the deferred call instructions (by
    identity, in its body and in the comprehensions' code it holds) and the graph's overlap groups."""

    block: CapturedBlock
    deferred: frozenset[int]  # id() of the deferred CALL instructions of `block.body`
    comprehensions: dict[int, tuple[types.CodeType, tuple[int, ...]]]  # id(new code) -> (code, deferred indexes)
    groups: list[tuple[str, ...]]


@dataclass(frozen=True)
class _Slot:
    """A stack item as the pass sees it: the deferred calls whose Pendings it is or holds, and the
    comprehension code it is the function of (3.11)."""

    calls: frozenset[int] = EMPTY
    comprehension: types.CodeType | None = None
    pure: bool = False  # a builtin function that only computes (`len`, `str`, `sorted`, ...)
    holder: bool = False  # a list holding Pendings (else, with calls, a Pending itself)

    def join(self, other: _Slot) -> _Slot:
        same = self.comprehension is other.comprehension
        return _Slot(self.calls | other.calls, self.comprehension if same else None, self.pure and other.pure,
                     self.holder or other.holder)


_PLAIN = _Slot()


@dataclass(frozen=True)
class _State:
    pending: frozenset[str]  # variables that may hold a Pending, or a list with Pendings
    bound: frozenset[str]  # variables bound on every path here
    open: frozenset[str]  # graph nodes of deferred calls that may be open (OUTER: the enclosing code's)
    stack: tuple[_Slot, ...]
    holds: frozenset[tuple[str, str]] = EMPTY  # (variable, graph node of the deferred call whose Pending it may hold)

    def join(self, other: _State) -> _State:
        stack = tuple(a.join(b) for a, b in zip(self.stack, other.stack))
        return _State(self.pending | other.pending, self.bound & other.bound, self.open | other.open, stack,
                      self.holds | other.holds)

    def release(self, names: Iterable[str], node_of: Callable[[int], str]) -> _State:
        """`names` resolved: they hold no Pending, and the calls no variable or stack item holds any more are no
        longer open (waited for, as far as the overlap groups go)."""
        gone = set(names)
        holds = frozenset(h for h in self.holds if h[0] not in gone)
        still = {node for _, node in holds} | {node_of(i) for slot in self.stack for i in slot.calls}
        released = {node for var, node in self.holds if var in gone} - still
        return replace(self, pending=self.pending - gone, holds=holds, open=self.open - released)


@dataclass
class _Actions:
    """What goes before one element: a settle, variables resolved, the top of the stack resolved or
    made a loop's `iterable`."""

    settle: bool = False
    resolve: list[str] = field(default_factory=list)
    resolve_top: bool = False
    iterate_top: bool = False


class _Demote(Exception):
    """A Pending would reach code the pass cannot rewrite: these calls are waited for where they are made."""

    def __init__(self, calls: frozenset[int]) -> None:
        self.calls = calls


class _Pass:
    """The rewrite of one instruction list: the captured body, or a 3.11 list comprehension's code."""

    def __init__(self, body: list[Any], site_node: Callable[[Instr], tuple[str, bool] | None], entry: _State,
                 output: str | None, nested_reads: frozenset[str], shadowed: frozenset[str], *,
                 comprehensions: bool) -> None:
        self.body, self.site_node, self.entry, self.output = body, site_node, entry, output
        self.comprehensions = comprehensions  # 3.11 list comprehensions called here are rewritten too
        self.succ = successors(tuple(body))
        self.label_at = {id(e): i for i, e in enumerate(body) if isinstance(e, Label)}
        self.guarded = _guarded(body, self.label_at)
        self.nested_reads = nested_reads
        self.store_ops: dict[str, Instr] = {}
        for e in body:
            if isinstance(e, Instr) and e.name in _STORES:
                self.store_ops.setdefault(name_of(e.arg), e)
        stored = {name_of(e.arg) for e in body if isinstance(e, Instr) and e.name in _STORES | {"STORE_GLOBAL"}}
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
        if nxt.name in _STORES and name_of(nxt.arg) in self.nested_reads:
            return "call"
        return "deferred"

    # -- the forward pass ----------------------------------------------------------------------------
    def run(self) -> tuple[list[_State | None], list[_Actions]]:
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

    def _fixpoint(self) -> tuple[list[_State | None], list[_Actions]]:
        states: list[_State | None] = [None] * len(self.body)
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
        actions = [self._step(i, s)[0] if s is not None else _Actions() for i, s in enumerate(states)]
        return states, actions

    def _step(self, i: int, state: _State) -> tuple[_Actions, list[tuple[int, _State]]]:
        e = self.body[i]
        acts = _Actions()
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

    def _before(self, i: int, e: Instr, state: _State, acts: _Actions) -> _State:
        """The waits `e` needs before it runs, added to `acts`; the state they leave."""
        kind = self.kind(i) if e.name in CALL_OPS else None
        if kind in ("deferred", "call"):
            self._overlaps(e, state)
        pops = pops_pushes(e)[0]
        popped = state.stack[len(state.stack) - pops:] if pops else ()
        comprehension = next((s.comprehension for s in popped if s.comprehension is not None), None)
        if e.name in CALL_OPS and comprehension is not None and not self.guarded[i]:
            self.comprehension_open[id(comprehension)] = state.open
            self.pairs.update((node, _COMPREHENSION) for node in state.open if node != OUTER)  # its calls overlap them
            return self._resolve(acts, state, sorted(_reads_of(comprehension) & state.pending))
        pure = e.name in CALL_OPS and any(s.pure for s in popped[:2])
        unsafe = self.guarded[i] or (e.name not in _SAFE and kind not in ("deferred", "call") and not pure)
        if unsafe:
            state = self._close(acts, state)
        reads = [name_of(e.arg)] if e.name in _READS else []
        state = self._resolve(acts, state, [v for v in reads if v in state.pending])
        if unsafe:
            return state
        if e.name == "GET_ITER":
            acts.iterate_top = True
        tagged = [k for k, s in enumerate(popped) if s.calls]
        moves = e.name in _MOVES and not (e.name == "LIST_APPEND" and popped[-1].holder)  # lists of lists: one level
        if tagged and not moves:
            if tagged != [len(popped) - 1]:
                raise _Demote(frozenset().union(*(popped[k].calls for k in tagged)))
            acts.resolve_top = True
            state = replace(state, stack=state.stack[:-1] + (_PLAIN,))
        return state

    def _close(self, acts: _Actions, state: _State, extra: Iterable[str | None] = ()) -> _State:
        """Close the window: settle, then resolve every variable that may hold a Pending and is bound."""
        if not (state.open or state.pending or any(s.calls for s in state.stack)):
            return state
        acts.settle = True
        names = sorted((state.pending & state.bound) | {v for v in extra if v is not None})
        acts.resolve += [v for v in names if v not in acts.resolve]
        tagged = [k for k, s in enumerate(state.stack) if s.calls]
        stack = state.stack
        if tagged:
            if tagged != [len(stack) - 1]:
                raise _Demote(frozenset().union(*(stack[k].calls for k in tagged)))
            acts.resolve_top = True
            stack = stack[:-1] + (_PLAIN,)
        state = replace(state, stack=stack).release(names, self.node_of)
        return replace(state, open=EMPTY)

    def _resolve(self, acts: _Actions, state: _State, names: list[str]) -> _State:
        acts.resolve += [v for v in names if v not in acts.resolve]
        return state.release(names, self.node_of)

    def node_of(self, i: int) -> str:
        found = self.site_node(self.body[i])
        assert found is not None
        return found[0]

    def _overlaps(self, e: Instr, state: _State) -> None:
        found = self.site_node(e)
        assert found is not None
        node = found[0]
        self.pairs.update((node, other) for other in state.open if other != OUTER)

    def _effect(self, i: int, e: Instr, state: _State, jump: bool) -> _State:
        """The state after `e` runs (after its waits)."""
        name = e.name
        reach = int(e.arg) if name in ("SWAP", "COPY", "LIST_APPEND") else pops_pushes(e, jump)[0]
        stack = [_PLAIN] * max(0, reach + 1 - len(state.stack)) + list(state.stack)  # never short of what it reads
        if name in _STORES or name in _DELETES:
            var = name_of(e.arg)
            top = stack.pop() if name in _STORES else _PLAIN
            pending = state.pending | {var} if top.calls else state.pending - {var}
            bound = state.bound | {var} if name in _STORES else state.bound - {var}
            holds = frozenset(h for h in state.holds if h[0] != var) | {(var, self.node_of(c)) for c in top.calls}
            return replace(state, pending=pending, bound=bound, stack=tuple(stack), holds=holds)
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
        code = e.arg if name == "LOAD_CONST" and self.comprehensions and _is_comprehension(e.arg) else None
        if name in ("MAKE_FUNCTION", "SET_FUNCTION_ATTRIBUTE"):
            code = next((s.comprehension for s in popped if s.comprehension is not None), None)
        pure = name in ("LOAD_GLOBAL", "LOAD_NAME") and name_of(e.arg) in self.pure_builtins
        stack += [_PLAIN] * (pushes - 1) + [_Slot(comprehension=code, pure=pure)] if pushes else []
        return replace(state, stack=tuple(stack))


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


def _is_comprehension(obj: Any) -> bool:
    return isinstance(obj, types.CodeType) and obj.co_name == _COMPREHENSION


def _reads_of(code: types.CodeType) -> frozenset[str]:
    """Variables of the enclosing code that nested code reads: its free variables and globals, recursively."""
    found = set(code.co_freevars) | set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            found |= _reads_of(const)
    return frozenset(found)


# -- emitting ------------------------------------------------------------------------------------------


def _load(fn: str, scope: str, location: Any) -> Instr:
    """Load one of the runtime's functions, which `Program.run` puts in the globals the code runs with."""
    if scope == "module":
        return Instr("LOAD_NAME", RUNTIME_NAMES[fn], location=location)
    return Instr("LOAD_GLOBAL", (False, RUNTIME_NAMES[fn]), location=location)


def _call(fn: str, scope: str, args: list[Instr], location: Any) -> list[Instr]:
    """Call the runtime's `fn` with the values `args` push; its result is left on the stack."""
    n = len(args)
    head = [_load(fn, scope, location), Instr("PUSH_NULL", location=location)]
    if not PY313:
        head.reverse()
    tail = [Instr("CALL", n, location=location)]
    if not PY312:
        tail.insert(0, Instr("PRECALL", n, location=location))
    return head + args + tail


def _on_top(fn: str, scope: str, location: Any) -> list[Instr]:
    """Replace the top of the stack by `fn(top)`, slipping the callable (and NULL) under it."""
    if PY313:
        pre = [_load(fn, scope, location), Instr("SWAP", 2, location=location),
               Instr("PUSH_NULL", location=location), Instr("SWAP", 2, location=location)]
    else:
        pre = [Instr("PUSH_NULL", location=location), Instr("SWAP", 2, location=location),
               _load(fn, scope, location), Instr("SWAP", 2, location=location)]
    tail = [Instr("CALL", 1, location=location)]
    if not PY312:
        tail.insert(0, Instr("PRECALL", 1, location=location))
    return pre + tail


def _emit(p: _Pass, acts: _Actions, scope: str, location: Any) -> list[Instr]:
    out: list[Instr] = []
    if acts.settle:
        out += _call("settle", scope, [], location) + [Instr("POP_TOP", location=location)]
    if acts.resolve_top:
        out += _on_top("resolve", scope, location)
    for var in acts.resolve:
        store = p.store_ops[var]
        load = Instr(_LOAD_OF[store.name], store.arg, location=location)
        out += _call("resolve", scope, [load], location) + [Instr(store.name, store.arg, location=location)]
    if acts.iterate_top:
        out += _on_top("iterable", scope, location)
    return out


def _place(out: list[Any], e: Any, waits: list[Instr]) -> None:
    """Append `waits` then `e` to `out`; before a call, the waits go ahead of its KW_NAMES and PRECALL,
    which must stay next to it."""
    at = len(out)
    if isinstance(e, Instr) and e.name in CALL_OPS:
        while at and isinstance(out[at - 1], Instr) and out[at - 1].name in ("KW_NAMES", "PRECALL"):
            at -= 1
    out[at:at] = waits
    out.append(e)


def _split(body: Iterable[Any]) -> list[Any]:
    """3.13's two-variable instructions as two, so that a wait can go between them."""
    out: list[Any] = []
    for e in body:
        if isinstance(e, Instr) and e.name in _SPLIT:
            first, second = _SPLIT[e.name]
            out += [Instr(first, e.arg[0], location=e.location), Instr(second, e.arg[1], location=e.location)]
        else:
            out.append(e)
    return out


# -- the whole body ------------------------------------------------------------------------------------


def rewrite(
    block: CapturedBlock, graph: Graph, params: Iterable[str], output: str | None, module_globals: Mapping[str, Any]
) -> ParallelBody:
    """The captured `block` rewritten for parallel calls, with the graph's overlap groups."""
    site_node = _site_nodes(block.filename, graph)
    body = _split(block.body)
    nested = frozenset().union(*(_reads_of(e.arg) for e in body if isinstance(e, Instr)
                                 and isinstance(e.arg, types.CodeType) and not _is_comprehension(e.arg)))
    entry = _State(EMPTY, frozenset(params), EMPTY, ())
    shadowed = frozenset(module_globals).union(params)
    p = _Pass(body, site_node, entry, output, nested, shadowed, comprehensions=True)
    states, actions = p.run()
    comprehensions: dict[int, tuple[types.CodeType, tuple[int, ...]]] = {}
    new_body: list[Any] = []
    deferred: set[int] = set()
    pairs = set(p.pairs)
    for i, e in enumerate(body):
        waits = _emit(p, actions[i], block.scope, getattr(e, "location", None))
        if isinstance(e, Instr) and _is_comprehension(e.arg):
            outer_open = p.comprehension_open.get(id(e.arg), EMPTY)
            code, indexes, inner_pairs = _comprehension(e.arg, site_node, outer_open, shadowed)
            comprehensions[id(code)] = (code, indexes)
            pairs |= inner_pairs
            e = Instr(e.name, code, location=e.location)
        elif isinstance(e, Instr) and e.name in CALL_OPS and states[i] is not None and p.kind(i) == "deferred":
            deferred.add(id(e))
        _place(new_body, e, waits)
    groups = _groups({pair for pair in pairs if _COMPREHENSION not in pair})
    return ParallelBody(replace(block, body=tuple(new_body)), frozenset(deferred), comprehensions, groups)


def _comprehension(
    code: types.CodeType, site_node: Callable[[Instr], tuple[str, bool] | None], outer_open: frozenset[str],
    shadowed: frozenset[str],
) -> tuple[types.CodeType, tuple[int, ...], set[tuple[str, str]]]:
    """A 3.11 list comprehension's own code rewritten: its calls overlap with each other and with the
    enclosing code's open calls; it settles before returning its list."""
    bc = Bytecode.from_code(code)
    body = list(bc)
    entry = _State(EMPTY, frozenset(code.co_varnames[: code.co_argcount]), outer_open | {OUTER}, ())
    p = _Pass(body, site_node, entry, None, EMPTY, shadowed, comprehensions=False)
    states, actions = p.run()
    new_body: list[Any] = []
    deferred: list[Instr] = []
    for i, e in enumerate(body):
        if isinstance(e, Instr) and e.name in CALL_OPS and states[i] is not None and p.kind(i) == "deferred":
            deferred.append(e)
        _place(new_body, e, _emit(p, actions[i], "function", getattr(e, "location", None)))
    bc.clear()
    bc.extend(new_body)
    new = bc.to_code()
    return new, call_indexes(new, new_body, {id(e) for e in deferred}), set(p.pairs)


def call_indexes(code: types.CodeType, body: Iterable[Any], deferred: set[int]) -> tuple[int, ...]:
    """The code-unit indexes (offset // 2) in `code`, assembled from `body`, of the calls in `deferred`:
    the n-th call instruction of the body is the n-th of the code."""
    marks = [id(e) in deferred for e in body if isinstance(e, Instr) and e.name in CALL_OPS]
    offsets = [i.offset for i in dis.get_instructions(code) if i.opname in CALL_OPS]
    if len(marks) != len(offsets):
        raise AssertionError(f"{len(marks)} calls in the body, {len(offsets)} in its code")
    return tuple(offset // 2 for offset, mark in zip(offsets, marks) if mark)


def _site_nodes(filename: str, graph: Graph) -> Callable[[Instr], tuple[str, bool] | None]:
    """For a call instruction: its graph node and whether its method is `ordered=True`; None when the
    graph has no component call there."""
    components = graph.components()

    def lookup(e: Instr) -> tuple[str, bool] | None:
        if not isinstance(e, Instr) or e.name not in CALL_OPS or e.lineno is None:
            return None
        loc = e.location
        site = CallSite(filename, e.lineno, (loc.col_offset or 0) if loc else 0, (loc.end_col_offset or 0) if loc else 0)
        node = graph.node_at(site)
        if node is None:
            return None
        method = make_methods(type(components[node.component])).get(node.method)
        return node.id, bool(method is not None and method.ordered)

    return lookup


def _groups(pairs: set[tuple[str, str]]) -> list[tuple[str, ...]]:
    """Connected components of the overlap pairs, each in node order; a call paired with itself alone is a group."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        parent[find(a)] = find(b)
    members: dict[str, list[str]] = {}
    for x in sorted(parent, key=_node_order):
        members.setdefault(find(x), []).append(x)
    return sorted((tuple(m) for m in members.values()), key=lambda g: _node_order(g[0]))


def _node_order(node_id: str) -> tuple[int, str]:
    digits = node_id.lstrip("n")
    return (int(digits), node_id) if digits.isdigit() else (1 << 30, node_id)


def parallel_program(
    block: CapturedBlock, graph: Graph, params: tuple[str, ...], output: str | None, module_globals: Mapping[str, Any]
) -> Program | None:
    """The program a deployment runs with parallel calls, and `graph.overlap_groups` filled; None when
    no call of the block can be deferred (the program would be the block's own)."""
    rewritten = rewrite(block, graph, params, output, module_globals)
    if not rewritten.deferred and not any(indexes for _, indexes in rewritten.comprehensions.values()):
        return None
    program = assemble(rewritten.block, params, output, module_globals)
    top = call_indexes(program.code, rewritten.block.body, set(rewritten.deferred))
    deferred: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), top)]
    for k, const in enumerate(program.code.co_consts):
        if isinstance(const, types.CodeType) and id(const) in rewritten.comprehensions:
            deferred.append(((k,), rewritten.comprehensions[id(const)][1]))
    graph.overlap_groups = rewritten.groups
    return replace(program, deferred=tuple((path, idx) for path, idx in deferred if idx))
