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

from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from bytecode import Instr, Label, TryBegin

from patchkit.capture.analysis import successors
from patchkit.capture.compat import CALL_OPS, PY313, name_of
from patchkit.capture.ir import BlockExit
from patchkit.capture.overlap_state import (
    BOOLEANS,
    COMPREHENSION,
    DEFER_INTO,
    DELETES,
    EMPTY,
    FAST_LOADS,
    MOVES,
    OUTER,
    PLAIN,
    PURE_BUILTINS,
    READS,
    REFLECTIVE,
    SAFE,
    SCALAR_CONSTS,
    SCALAR_OPS,
    STORES,
    TESTS,
    Actions,
    Demote,
    SiteNode,
    Slot,
    State,
    call_guard_of,
    guard_of,
    in_user_try,
    is_comprehension,
    reads_of,
)
from patchkit.capture.stack import pops_pushes

__all__ = ["OverlapPass"]

class OverlapPass:
    """The rewrite of one instruction list: the captured body, or a 3.11 list comprehension's code."""

    def __init__(self, body: list[Any], site_node: SiteNode, entry: State,
                 output: str | None, nested_reads: frozenset[str], shadowed: frozenset[str], *,
                 comprehensions: bool) -> None:
        self.body, self.site_node, self.entry, self.output = body, site_node, entry, output
        self.comprehensions = comprehensions  # 3.11 list comprehensions called here are rewritten too
        self.succ = successors(tuple(body))
        self.label_at = {id(e): i for i, e in enumerate(body) if isinstance(e, Label)}
        self.guarded = in_user_try(body, self.label_at)
        self.nested_reads = nested_reads
        self.reflective = bool(nested_reads & REFLECTIVE)
        self.store_ops: dict[str, Instr] = {}
        for e in body:
            if isinstance(e, Instr) and e.name in STORES:
                self.store_ops.setdefault(name_of(e.arg), e)
        stored = {name_of(e.arg) for e in body if isinstance(e, Instr) and e.name in STORES | {"STORE_GLOBAL"}}
        self.pure_builtins = PURE_BUILTINS - stored - shadowed
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
        if not isinstance(nxt, Instr) or nxt.name not in DEFER_INTO or self.guarded[i] or i in self.demoted:
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
            except Demote as demote:
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
            kept = (PLAIN,) * max(0, depth - len(state.stack)) + state.stack[:depth]
            handler = replace(state, stack=kept + (PLAIN,) * (1 + int(e.push_lasti)))
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
        unsafe = self.guarded[i] or self.late_read(e) or (e.name not in SAFE and kind not in ("deferred", "call")
                                                           and not pure)
        if unsafe:
            state = self._close(acts, state)
        reads = [name_of(e.arg)] if e.name in READS else []
        state = self._resolve(acts, state, [v for v in reads if v in state.pending])
        if unsafe:
            return state
        if e.name == "GET_ITER":
            acts.iterate_top = True
        moves = e.name in MOVES and not (e.name == "LIST_APPEND" and popped[-1].holder)  # lists of lists: one level
        state = state if moves else self._resolve_top(acts, state, popped)
        plain = (e.name in TESTS and popped[-1].boolean) or (e.name in SCALAR_OPS and all(s.scalar for s in popped))
        if state.open and not plain:
            acts.guard = guard_of(e, popped) if not pure else call_guard_of(popped)
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

    def _resolve_top(self, acts: Actions, state: State, slots: tuple[Slot, ...]) -> State:
        """The Pendings held in `slots` (the top of the stack) resolved: at its very top, where a wait can
        reach them; deeper, the calls that made them are waited for where they are made instead."""
        tagged = [k for k, s in enumerate(slots) if s.calls]
        if not tagged:
            return state
        if tagged != [len(slots) - 1]:
            raise Demote(frozenset().union(*(slots[k].calls for k in tagged)))
        acts.resolve_top = True
        return replace(state, stack=state.stack[:-1] + (PLAIN,))

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
        stack = [PLAIN] * max(0, reach + 1 - len(state.stack)) + list(state.stack)  # never short of what it reads
        if name in STORES or name in DELETES:
            var = name_of(e.arg)
            top = stack.pop() if name in STORES else PLAIN
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
            stack[k] = Slot(stack[k].calls | item.calls, stack[k].comprehension, holder=stack[k].holder or bool(item.calls))
            return replace(state, stack=tuple(stack))
        pops, pushes = pops_pushes(e, jump)
        popped = stack[len(stack) - pops:] if pops else []
        del stack[len(stack) - len(popped):]
        if name in CALL_OPS and self.kind(i) == "deferred":
            stack.append(Slot(frozenset({i})))
            node = self.site_node(e)
            assert node is not None
            return replace(state, open=state.open | {node[0]}, stack=tuple(stack))
        code = e.arg if name == "LOAD_CONST" and self.comprehensions and is_comprehension(e.arg) else None
        if name in ("MAKE_FUNCTION", "SET_FUNCTION_ATTRIBUTE"):
            code = next((s.comprehension for s in popped if s.comprehension is not None), None)
        pure = name in ("LOAD_GLOBAL", "LOAD_NAME") and name_of(e.arg) in self.pure_builtins
        scalar = (name in FAST_LOADS and name_of(e.arg) in state.scalars) or name == "BUILD_STRING" \
            or (name == "LOAD_CONST" and type(e.arg) in SCALAR_CONSTS) or name in ("IS_OP", "CONTAINS_OP") \
            or (name in SCALAR_OPS and all(s.scalar for s in popped))
        top = Slot(comprehension=code, pure=pure, boolean=name in BOOLEANS, scalar=scalar)
        stack += [PLAIN] * (pushes - 1) + [top] if pushes else []
        if name == "LOAD_FAST_AND_CLEAR":
            state = replace(state, scalars=state.scalars - {name_of(e.arg)})
        return replace(state, stack=tuple(stack))
