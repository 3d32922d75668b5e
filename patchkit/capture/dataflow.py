"""IR -> graph: a data-flow pass over the captured body that finds the component calls.

The pass interprets the body's instructions over abstract values: each value carries the set of
sources it derives from (call nodes and `input:<name>`), the object it is known to be (a
Component, a `@make` method, a function, a nested code object) and the variable it was loaded
from. Variables are tracked flow-insensitively, iterated to a fixed point. A call whose callee is
a `@make` method becomes a node with data edges from its arguments' sources; calls into nested
code (comprehensions, lambdas) and into the user's own helper functions are analysed in place,
so a component called inside a helper is still that component; so are the methods of an object
the block holds (`self.search(q)`) and `super()`'s. Every component reachable from an object the
body loads (`self.retriever`, a dict of tools) is registered with the graph, called on the capture
run or not. Control dependence comes from post-dominators over the body's control-flow graph;
loops from its backward jumps.
"""

from __future__ import annotations

import builtins
import inspect
import os
import sysconfig
import types
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bytecode import Bytecode, CellVar, FreeVar, Instr, Label, TryBegin

from patchkit.capture.analysis import reachable, successors
from patchkit.capture.compat import name_of
from patchkit.capture.graph import OUTPUT, PART, Graph, Guard, Loop
from patchkit.capture.holders import held_components
from patchkit.capture.ir import BlockExit, CapturedBlock
from patchkit.capture.recorder import CallSite
from patchkit.capture.stack import pops_pushes
from patchkit.component import Component, make_methods

__all__ = ["build_graph"]

MAX_DEPTH = 4
_EMPTY: frozenset[str] = frozenset()
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_PATCHKIT_DIR = str(Path(__file__).resolve().parents[1]) + os.sep
_LOADS = frozenset(
    {"LOAD_NAME", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_GLOBAL"}
)
_STORES = frozenset({"STORE_NAME", "STORE_FAST", "STORE_DEREF", "STORE_GLOBAL"})
_BUILDS = frozenset({"BUILD_LIST", "BUILD_TUPLE", "BUILD_MAP", "BUILD_CONST_KEY_MAP"})  # containers of their operands
_ADDS = frozenset({"LIST_APPEND", "SET_ADD", "MAP_ADD", "LIST_EXTEND", "SET_UPDATE", "DICT_UPDATE", "DICT_MERGE"})


@dataclass(frozen=True)
class _MakeRef:
    component: Component
    method: str
    name: str


@dataclass(frozen=True)
class _CodeRef:
    code: types.CodeType


@dataclass(frozen=True, eq=False)
class _SuperRef:
    """`super(cls, obj)`: its attributes are looked up on obj's class after cls."""

    cls: type
    obj: Any

    def lookup(self, attr: str) -> Any:
        mro = type(self.obj).__mro__
        after = mro[mro.index(self.cls) + 1 :] if self.cls in mro else ()
        for klass in after:
            if attr in vars(klass):
                return _bind(vars(klass)[attr], self.obj)
        return None


def _bind(attr: Any, obj: Any) -> Any:
    """A plain function found on a class, bound to `obj` as a method; anything else, None."""
    return types.MethodType(attr, obj) if isinstance(attr, types.FunctionType) else None


@dataclass(frozen=True)
class Value:
    taint: frozenset[str] = _EMPTY
    obj: Any = None
    origin: str | None = None
    # The call nodes whose very result this value is, or holds as an item of a list, tuple or dict built
    # from it: a streaming call among them makes (part of) the output as it is, so its chunks may stream.
    parts: frozenset[str] = _EMPTY

    def join(self, other: Value) -> Value:
        same = self.obj is other.obj or (isinstance(self.obj, (_MakeRef, _CodeRef)) and self.obj == other.obj)
        obj = self.obj if same else None
        origin = self.origin if self.origin == other.origin else None
        return Value(self.taint | other.taint, obj, origin, self.parts | other.parts)


def _union(values: list[Value]) -> frozenset[str]:
    return frozenset().union(*(v.taint for v in values)) if values else _EMPTY


Env = dict[str, Value]


@dataclass
class _Scope:
    """Name resolution for one analysed code object: its globals, closure cells and enclosing scope.

    Variables live in the flow-sensitive environment of each program point, not here; `outer_env`
    is the enclosing body's environment where the nested code was called.
    """

    module_level: bool
    globals: Mapping[str, Any]
    outer: _Scope | None = None
    outer_env: Env = field(default_factory=dict)
    cells: Mapping[str, Any] = field(default_factory=dict)

    def load(self, env: Env, op: str, name: str) -> Value:
        if op == "LOAD_GLOBAL" and not self.module_level:
            if self.outer is not None and self.outer.module_level:
                return self.outer.load(self.outer_env, "LOAD_NAME", name)
            return Value(obj=self.globals.get(name, _builtin(name)), origin=name)
        if name in env:
            return Value(env[name].taint, env[name].obj, name, env[name].parts)
        if op in ("LOAD_DEREF", "LOAD_CLOSURE") and self.outer is not None:
            return self.outer.load(self.outer_env, op, name)
        if name in self.cells:
            return Value(obj=self.cells[name], origin=name)
        if self.module_level or op == "LOAD_NAME":
            return Value(obj=self.globals.get(name, _builtin(name)), origin=name)
        return Value(origin=name)


def _builtin(name: str) -> Any:
    # Only `super` is of interest: `super(cls, self).method(...)` may call components.
    return builtins.super if name == "super" else None


def _absorb(env: Env, name: str | None, taint: frozenset[str]) -> None:
    """A method call or item store on a variable's value mutates it: the variable gains taint."""
    if name is not None and name in env and not taint <= env[name].taint:
        old = env[name]
        env[name] = Value(old.taint | taint, old.obj)


def _join_env(a: Env, b: Env) -> Env:
    out = dict(a)
    for name, value in b.items():
        out[name] = value if name not in out else out[name].join(value)
    return out


def _is_user_function(fn: Any) -> bool:
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return False
    path = code.co_filename
    return not (path.startswith(_LIBRARY_DIRS) or path.startswith("<frozen") or path.startswith(_PATCHKIT_DIR))


def _first_line(body: tuple[Any, ...], start: int) -> int:
    for e in body[start:]:
        if isinstance(e, Instr) and e.lineno is not None:
            return e.lineno
    return 0


def _natural_loop(preds: Mapping[int, list[int]], head: int, jump: int) -> set[int]:
    """The elements a backward jump to `head` repeats: those that reach the jump without passing the head."""
    return reachable((head, jump), lambda p: () if p == head else preds.get(p, ()))


class _Body:
    """Control structure of one instruction list: control dependence, loops, `except` regions.

    Control dependence and loops use normal control flow only: an exception edge would make every
    call after a `try` (or an inlined comprehension's cleanup handler) depend on it.
    """

    def __init__(self, body: tuple[Any, ...], filename: str, comprehension: bool, graph: Graph) -> None:
        self.body = body
        self.succ = successors(body)
        self.label_at = {id(e): i for i, e in enumerate(body) if isinstance(e, Label)}
        self.normal = [
            [j for j in nxt if not isinstance(e, TryBegin) or j == i + 1] for i, (e, nxt) in enumerate(zip(body, self.succ))
        ]
        self.controls = self._control_dependence()
        self.loops = self._loops(filename, comprehension, graph)
        self.excepts = self._except_regions()

    def _control_dependence(self) -> dict[int, set[int]]:
        """For each element, the branch elements that decide whether it runs (transitively)."""
        n = len(self.body)
        pdom: list[frozenset[int]] = [frozenset(range(n + 1))] * n + [frozenset({n})]
        changed = True
        while changed:
            changed = False
            for i in reversed(range(n)):
                new = frozenset({i}) | frozenset.intersection(*(pdom[s] for s in self.normal[i] or [n]))
                if new != pdom[i]:
                    pdom[i] = new
                    changed = True
        controls: dict[int, set[int]] = {}
        for b in range(n):
            if len(set(self.normal[b])) < 2:
                continue
            strict = pdom[b] - {b}
            for s in self.normal[b]:
                for node in pdom[s] - strict:
                    if node < n:
                        controls.setdefault(node, set()).add(b)
        for node in controls:  # a call guarded by an `if` inside a loop is guarded by the loop too
            controls[node] = reachable(controls[node], lambda b: controls.get(b, ()))
        return controls

    def _loops(self, filename: str, comprehension: bool, graph: Graph) -> dict[int, list[str]]:
        """Natural loops of the backward jumps: the elements each loop repeats."""
        preds: dict[int, list[int]] = {}
        for i, nxt in enumerate(self.normal):
            for j in nxt:
                preds.setdefault(j, []).append(i)
        members: dict[int, list[str]] = {}
        for j, e in enumerate(self.body):
            head = self.label_at.get(id(e.arg), j + 1) if isinstance(e, Instr) and e.has_jump() else j + 1
            if head > j:
                continue
            first = next((x for x in self.body[head:] if isinstance(x, Instr)), None)
            kind = "comprehension" if comprehension else ("for" if first is not None and first.name == "FOR_ITER" else "while")
            line = _first_line(self.body, head)
            loop_id = f"loop{line}_{zlib.crc32(filename.encode()) % 10_000}"
            graph.loops.setdefault(loop_id, Loop(loop_id, kind, filename, line))
            for i in _natural_loop(preds, head, j):
                if loop_id not in members.setdefault(i, []):
                    members[i].append(loop_id)
        return members

    def _except_regions(self) -> dict[int, list[int]]:
        """Elements of each `except` handler, reached by normal flow from its entry: i -> lines."""
        regions: dict[int, list[int]] = {}
        for e in self.body:
            if not isinstance(e, TryBegin):
                continue
            start = self.label_at[id(e.target)]
            line = _first_line(self.body, start)
            for i in reachable((start,), lambda k: self.normal[k]):
                if line not in regions.setdefault(i, []):
                    regions[i].append(line)
        return regions

    def guard_kind(self, b: int) -> tuple[str, int]:
        e = self.body[b]
        assert isinstance(e, Instr)
        if e.name == "FOR_ITER":
            return "for", e.lineno or 0
        backward = self.label_at.get(id(e.arg), b + 1) <= b
        return ("while" if backward else "if"), e.lineno or 0


class _Analysis:
    """One graph-building pass: the top-level body and, recursively, the code it calls."""

    def __init__(self, graph: Graph, filename: str) -> None:
        self.graph = graph
        self.filename = filename
        self._memo: dict[tuple[Any, ...], frozenset[str]] = {}
        self._registered: set[int] = set()
        self.output_parts: frozenset[str] = _EMPTY  # the `parts` of what the block returns or outputs

    def register(self, obj: Any, name: str | None) -> None:
        """Name, in the graph, every component reachable from an object the code loads."""
        if obj is None or id(obj) in self._registered or isinstance(obj, (_MakeRef, _CodeRef, _SuperRef)):
            return
        self._registered.add(id(obj))
        for label, component in held_components(obj, name or type(obj).__name__.lower()):
            self.graph.name_component(component, label)

    def run(
        self,
        body: tuple[Any, ...],
        scope: _Scope,
        env: Env,
        filename: str,
        context: tuple[list[Guard], list[str]],
        output: str | None = None,
        depth: int = 0,
        comprehension: bool = False,
    ) -> frozenset[str]:
        """Interpret `body` from `env` to a fixed point; returns the sources of what it returns."""
        if not body:
            return _EMPTY
        shape = _Body(body, filename, comprehension, self.graph)
        conditions: dict[int, frozenset[str]] = {}
        returned: frozenset[str] = _EMPTY
        entry: dict[int, tuple[tuple[Value, ...], Env]] = {0: ((), env)}
        todo = [0]
        while todo:
            i = todo.pop()
            step = _Step(self, shape, scope, filename, context, depth, conditions)
            stack, state = entry[i]
            for j, out_stack, out_env in step.run(i, list(stack), dict(state), output):
                if j in entry:
                    old_stack, old_env = entry[j]
                    out_stack, out_env = _merge(old_stack, out_stack), _join_env(old_env, out_env)
                    if out_stack == old_stack and out_env == old_env:
                        continue
                entry[j] = (out_stack, out_env)
                todo.append(j)
            returned |= step.returned
            if depth == 0:
                self.output_parts |= step.parts
        return returned

    def call(
        self, code: types.CodeType, scope: _Scope, env: Env, context: tuple[list[Guard], list[str]], depth: int
    ) -> frozenset[str]:
        """Analyse code called from the body (a comprehension, lambda or helper) in place."""
        if depth >= MAX_DEPTH:
            return _EMPTY
        key = (code, tuple(sorted((k, v.taint) for k, v in env.items())), tuple(context[1]), depth)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = _EMPTY  # recursion guard
        body = tuple(Bytecode.from_code(code))
        comprehension = code.co_name in ("<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>")
        result = self.run(body, scope, env, code.co_filename, context, depth=depth + 1, comprehension=comprehension)
        self._memo[key] = result
        return result


def _merge(a: tuple[Value, ...], b: tuple[Value, ...]) -> tuple[Value, ...]:
    return tuple(x.join(y) for x, y in zip(a, b))


class _Step:
    """Interprets one element of a body: its effect on stack and variables, and where control goes."""

    def __init__(
        self,
        analysis: _Analysis,
        shape: _Body,
        scope: _Scope,
        filename: str,
        context: tuple[list[Guard], list[str]],
        depth: int,
        conditions: dict[int, frozenset[str]],
    ) -> None:
        self.analysis = analysis
        self.shape = shape
        self.scope = scope
        self.filename = filename
        self.context = context
        self.depth = depth
        self.conditions = conditions
        self.returned: frozenset[str] = _EMPTY
        self.parts: frozenset[str] = _EMPTY  # the `parts` of what it returns
        self.env: Env = {}

    def run(self, i: int, stack: list[Value], env: Env, output: str | None) -> list[tuple[int, tuple[Value, ...], Env]]:
        self.env = env
        e = self.shape.body[i]
        succ = self.shape.succ[i]
        if isinstance(e, BlockExit):
            if output is not None:
                value = self.scope.load(env, "LOAD_NAME", output)
                self.returned |= value.taint
                self.parts |= value.parts
            return []
        if isinstance(e, TryBegin):
            depth = e.stack_depth if isinstance(e.stack_depth, int) else len(stack)
            handler = tuple(stack[:depth]) + (Value(),) * (1 + int(e.push_lasti))
            return [(i + 1, tuple(stack), env)] + ([(succ[1], handler, env)] if len(succ) > 1 else [])
        if not isinstance(e, Instr):
            return [(i + 1, tuple(stack), env)] if i + 1 < len(self.shape.body) else []
        if e.has_jump() and not e.is_uncond_jump():
            return self._branch(i, e, stack)
        self._execute(i, e, stack)
        return [(j, tuple(stack), env) for j in succ]

    def _branch(self, i: int, e: Instr, stack: list[Value]) -> list[tuple[int, tuple[Value, ...], Env]]:
        cond = stack[-1].taint if stack else _EMPTY
        self.conditions[i] = self.conditions.get(i, _EMPTY) | cond
        target = self.shape.label_at[id(e.arg)]
        out = []
        for j, jump in ((target, True), (i + 1, False)):
            pops, pushes = pops_pushes(e, jump)
            s = stack[: len(stack) - pops] if pops else list(stack)
            s += [Value(cond)] * pushes
            if j < len(self.shape.body):
                out.append((j, tuple(s), self.env))
        return out

    def _load(self, op: str, name: str) -> Value:
        value = self.scope.load(self.env, op, name)
        self.analysis.register(value.obj, name)
        return value

    def _execute(self, i: int, e: Instr, stack: list[Value]) -> None:
        name = e.name
        if name in _LOADS:
            pushes = pops_pushes(e)[1] if name == "LOAD_GLOBAL" else 1
            stack += [Value()] * (pushes - 1) + [self._load(name, name_of(e.arg))]
        elif name == "LOAD_FAST_LOAD_FAST":
            stack += [self._load("LOAD_FAST", n) for n in e.arg]
        elif name == "LOAD_SUPER_ATTR":
            self._super_attribute(e, stack)
        elif name in _STORES:
            value = stack.pop() if stack else Value()
            self.env[name_of(e.arg)] = Value(value.taint, value.obj, parts=value.parts)
        elif name in ("DELETE_NAME", "DELETE_FAST", "DELETE_DEREF"):
            self.env.pop(name_of(e.arg), None)
        elif name == "LOAD_CONST":
            stack.append(Value(obj=_CodeRef(e.arg) if isinstance(e.arg, types.CodeType) else None))
        elif name in ("LOAD_ATTR", "LOAD_METHOD"):
            self._attribute(e, stack)
        elif name == "SWAP":
            n = int(e.arg)
            if len(stack) >= n:
                stack[-1], stack[-n] = stack[-n], stack[-1]
        elif name == "COPY":
            stack.append(stack[-int(e.arg)] if len(stack) >= int(e.arg) else Value())
        elif name in ("CALL", "CALL_KW", "CALL_FUNCTION_EX"):
            self._call(i, e, stack)
        elif name in ("RETURN_VALUE", "YIELD_VALUE"):
            value = stack.pop() if stack else Value()
            self.returned |= value.taint
            self.parts |= value.parts
        else:
            self._generic(e, stack)

    def _attribute(self, e: Instr, stack: list[Value]) -> None:
        owner = stack.pop() if stack else Value()
        attr = name_of(e.arg)
        obj: Any = None
        if isinstance(owner.obj, Component) and attr in make_methods(type(owner.obj)):
            obj = _MakeRef(owner.obj, attr, owner.origin or type(owner.obj).__name__.lower())
        elif isinstance(owner.obj, _SuperRef):
            obj = owner.obj.lookup(attr)
        elif owner.obj is not None and not isinstance(owner.obj, type) and hasattr(owner.obj, "__dict__"):
            obj = vars(owner.obj).get(attr)  # modules and plain instances; no descriptors run
            if obj is None and not isinstance(owner.obj, (types.ModuleType, Component)):
                obj = _bind(inspect.getattr_static(type(owner.obj), attr, None), owner.obj)  # a method
            self.analysis.register(obj, attr)
        pushes = pops_pushes(e)[1]
        stack += [Value(owner.taint, obj, owner.origin)] * pushes

    def _super_attribute(self, e: Instr, stack: list[Value]) -> None:
        """3.12+: `super(cls, self).name`, popping super, cls and self in one instruction."""
        pops, pushes = pops_pushes(e)
        popped = stack[len(stack) - pops :] if pops else []
        del stack[len(stack) - len(popped) :]
        obj: Any = None
        if len(popped) == 3 and popped[0].obj is builtins.super and isinstance(popped[1].obj, type):
            obj = _SuperRef(popped[1].obj, popped[2].obj).lookup(name_of(e.arg))
        stack += [Value(_union(popped), obj)] * pushes

    def _generic(self, e: Instr, stack: list[Value]) -> None:
        pops, pushes = pops_pushes(e)
        popped = stack[len(stack) - pops :] if pops else []
        del stack[len(stack) - len(popped) :]
        if e.name in _ADDS and stack:
            # comprehension results and `x += [...]`-style updates derive from what is added
            target = len(stack) - int(e.arg)
            if 0 <= target < len(stack):
                stack[target] = Value(stack[target].taint | _union(popped), stack[target].obj, stack[target].origin)
        if e.name in ("STORE_SUBSCR", "STORE_ATTR") and len(popped) >= 2:
            container = popped[1] if e.name == "STORE_SUBSCR" else popped[-1]
            _absorb(self.env, container.origin, popped[0].taint)
        code = next((v.obj for v in popped if isinstance(v.obj, _CodeRef)), None)
        keep_code = e.name in ("MAKE_FUNCTION", "SET_FUNCTION_ATTRIBUTE")
        parts = frozenset().union(*(v.parts for v in popped)) if e.name in _BUILDS else _EMPTY
        stack += [Value(_union(popped), code if keep_code else None, parts=parts)] * pushes

    def _context_at(self, i: int) -> tuple[list[Guard], list[str]]:
        guards = list(self.context[0])
        for b in sorted(self.shape.controls.get(i, ())):
            kind, line = self.shape.guard_kind(b)
            if all((g.kind, g.lineno) != (kind, line) for g in guards):
                guards.append(Guard(kind, line, self.conditions.get(b, _EMPTY)))
        for line in self.shape.excepts.get(i, ()):
            if all((g.kind, g.lineno) != ("except", line) for g in guards):
                guards.append(Guard("except", line, _EMPTY))
        loops = list(self.context[1]) + [x for x in self.shape.loops.get(i, []) if x not in self.context[1]]
        return guards, loops

    def _call(self, i: int, e: Instr, stack: list[Value]) -> None:
        pops, _ = pops_pushes(e)
        popped = stack[len(stack) - pops :]
        del stack[len(stack) - len(popped) :]
        ref = next((v.obj for v in popped[:2] if _is_callable_ref(v.obj)), None)
        args = [v for v in popped if v.obj is not ref or ref is None]
        taint = _union(args)
        if isinstance(ref, _MakeRef):
            node = frozenset({self._node(i, e, ref, taint)})
            stack.append(Value(node, parts=node))
            return
        if len(popped) == 4 and any(v.obj is builtins.super for v in popped[:2]) and isinstance(popped[2].obj, type):
            stack.append(Value(taint, _SuperRef(popped[2].obj, popped[3].obj)))  # super(cls, self)
            return
        result = taint
        if ref is not None:
            result |= self._enter(i, ref, taint)
        for v in args:  # a lambda or helper passed as an argument runs with the other arguments
            if isinstance(v.obj, _CodeRef) or _is_user_function(v.obj):
                result |= self._enter(i, v.obj, taint)
        receiver = popped[1] if len(popped) > 1 else Value()
        _absorb(self.env, receiver.origin, taint - receiver.taint)
        stack.append(Value(result))

    def _enter(self, i: int, ref: Any, taint: frozenset[str]) -> frozenset[str]:
        if isinstance(ref, _CodeRef):
            code = ref.code
            scope = _Scope(False, self.scope.globals, outer=self.scope, outer_env=dict(self.env))
        else:
            fn = getattr(ref, "__func__", ref)
            code = fn.__code__
            closure = fn.__closure__ or ()
            scope = _Scope(False, fn.__globals__, cells=dict(zip(code.co_freevars, (c.cell_contents for c in closure))))
        nparams = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x4) + bool(code.co_flags & 0x8)
        env = {param: Value(taint) for param in code.co_varnames[:nparams]}
        if isinstance(ref, types.MethodType) and code.co_argcount:  # a method: its `self` is known
            env[code.co_varnames[0]] = Value(taint, ref.__self__)
        return self.analysis.call(code, scope, env, self._context_at(i), self.depth)

    def _node(self, i: int, e: Instr, ref: _MakeRef, taint: frozenset[str]) -> str:
        graph = self.analysis.graph
        loc = e.location
        site = CallSite(
            self.filename, e.lineno or 0, (loc.col_offset or 0) if loc else 0, (loc.end_col_offset or 0) if loc else 0
        )
        node = graph.node_for(site, graph.name_of(ref.component) or ref.name, ref.component, ref.method)
        for src in sorted(taint):
            graph.add_edge(src, node.id, "data")
        guards, loops = self._context_at(i)
        for guard in guards:
            if all((g.kind, g.lineno) != (guard.kind, guard.lineno) for g in node.guards):
                node.guards.append(guard)
            for src in sorted(guard.sources):
                graph.add_edge(src, node.id, "control", f"{guard.kind} L{guard.lineno}")
        node.loops.extend(x for x in loops if x not in node.loops)
        return node.id


def _is_callable_ref(obj: Any) -> bool:
    return isinstance(obj, (_MakeRef, _CodeRef)) or _is_user_function(obj)


def build_graph(
    block: CapturedBlock,
    inputs: Mapping[str, Any],
    bindings: Mapping[str, Any],
    module_globals: Mapping[str, Any],
    output: str | None,
) -> Graph:
    """The graph of a captured block, from its body and the frame's inputs and bound objects."""
    graph = Graph(inputs)
    module_level = block.scope == "module"
    variables = {name: Value(frozenset({f"input:{name}"})) for name in inputs}
    variables.update({name: Value(obj=obj) for name, obj in bindings.items()})
    for name, obj in bindings.items():
        if isinstance(obj, Component):
            graph.name_component(obj, name)
    analysis = _Analysis(graph, block.filename)
    for name, obj in bindings.items():  # the components objects hold, by their own names
        analysis.register(obj, name)
    scope = _Scope(module_level, module_globals)
    body = tuple(_as_cell(e) for e in block.body)
    returned = analysis.run(body, scope, variables, block.filename, ([], []), output)
    graph.name_held()
    for src in sorted(returned):
        graph.add_edge(src, OUTPUT, "data", PART if src in analysis.output_parts else "")
    return graph


def _as_cell(e: Any) -> Any:
    if isinstance(e, Instr) and isinstance(e.arg, FreeVar):
        return Instr(e.name, CellVar(e.arg.name), location=e.location)
    return e
