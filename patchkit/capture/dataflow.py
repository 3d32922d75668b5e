"""IR -> graph: a data-flow pass over the captured body that finds the component calls.

The pass interprets the body's instructions over abstract values: each value carries the set of
sources it derives from (call nodes and `input:<name>`), the object it is known to be (a
Component, a `@make` method, a function, a nested code object) and the variable it was loaded
from. Variables are tracked flow-insensitively, iterated to a fixed point. A call whose callee is
a `@make` method becomes a node with data edges from its arguments' sources; calls into nested
code (comprehensions, lambdas) and into the user's own helper functions are analysed in place,
so a component called inside a helper is still that component (passed to it as an argument
too); so are the methods of an object the block holds (`self.search(q)`) and `super()`'s. Every
component reachable from an object the body loads (`self.retriever`, a dict of tools) is
registered with the graph, called on the capture run or not. The abstract values and name
resolution are `values.py`'s; control dependence (from post-dominators over the body's
control-flow graph) and loops (from its backward jumps) are `control.py`'s. `build_graph` is
called once per capture, by `client/capture.py`.
"""

from __future__ import annotations

import builtins
import inspect
import types
from collections.abc import Mapping
from typing import Any, NamedTuple

from bytecode import Bytecode, CellVar, FreeVar, Instr, TryBegin

from patchkit.capture.compat import name_of
from patchkit.capture.control import ControlFlow
from patchkit.capture.graph import OUTPUT, PART, Graph, Guard
from patchkit.capture.holders import held_components
from patchkit.capture.ir import BlockExit, CapturedBlock
from patchkit.capture.stack import pops_pushes
from patchkit.capture.values import (
    EMPTY,
    CodeRef,
    Env,
    MakeRef,
    Scope,
    SuperRef,
    Value,
    absorb,
    bind,
    constant_keys,
    dict_fields,
    is_callable_ref,
    is_user_function,
    join_env,
    merge,
    union,
)
from patchkit.core import CallSite, Component, make_methods

__all__ = ["build_graph"]

MAX_DEPTH = 4
_LOADS = frozenset(
    {"LOAD_NAME", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_GLOBAL"}
)
_STORES = frozenset({"STORE_NAME", "STORE_FAST", "STORE_DEREF", "STORE_GLOBAL"})
_BUILDS = frozenset({"BUILD_LIST", "BUILD_TUPLE", "BUILD_MAP", "BUILD_CONST_KEY_MAP"})  # containers of their operands
_ADDS = frozenset({"LIST_APPEND", "SET_ADD", "MAP_ADD", "LIST_EXTEND", "SET_UPDATE", "DICT_UPDATE", "DICT_MERGE"})


class Returned(NamedTuple):
    """What analysed code returns: its sources, the calls whose results it returns as they are (`parts`), and
    (key, call) for each of those a dict it returns holds under a constant key (`fields`)."""

    sources: frozenset[str]
    parts: frozenset[str]
    fields: frozenset[tuple[str, str]]


NOTHING = Returned(EMPTY, EMPTY, frozenset())


class _Analysis:
    """One graph-building pass: the top-level body and, recursively, the code it calls."""

    def __init__(self, graph: Graph, filename: str) -> None:
        self.graph = graph
        self.filename = filename
        self._memo: dict[tuple[Any, ...], Returned] = {}
        self._registered: set[int] = set()
        self.output_parts: frozenset[str] = EMPTY  # the `parts` of what the block returns or outputs
        self.output_fields: frozenset[tuple[str, str]] = frozenset()  # its `fields`: a dict output's keys by call

    def register(self, obj: Any, name: str | None) -> None:
        """Name, in the graph, every component reachable from an object the code loads."""
        if obj is None or id(obj) in self._registered or isinstance(obj, (MakeRef, CodeRef, SuperRef)):
            return
        self._registered.add(id(obj))
        for label, component in held_components(obj, name or type(obj).__name__.lower()):
            self.graph.name_component(component, label)

    def run(
        self,
        body: tuple[Any, ...],
        scope: Scope,
        env: Env,
        filename: str,
        context: tuple[list[Guard], list[str]],
        output: str | None = None,
        depth: int = 0,
        comprehension: bool = False,
    ) -> Returned:
        """Interpret `body` from `env` to a fixed point; returns the sources of what it returns, the calls whose
        results it returns as they are (its `parts`), and the fields of a dict it returns that hold them."""
        if not body:
            return NOTHING
        shape = ControlFlow(body, filename, comprehension, self.graph)
        conditions: dict[int, frozenset[str]] = {}
        returned: frozenset[str] = EMPTY
        parts: frozenset[str] = EMPTY
        fields: frozenset[tuple[str, str]] = frozenset()
        entry: dict[int, tuple[tuple[Value, ...], Env]] = {0: ((), env)}
        todo = [0]
        while todo:
            i = todo.pop()
            step = _Step(self, shape, scope, filename, context, depth, conditions)
            stack, state = entry[i]
            for j, out_stack, out_env in step.run(i, list(stack), dict(state), output):
                if j in entry:
                    old_stack, old_env = entry[j]
                    out_stack, out_env = merge(old_stack, out_stack), join_env(old_env, out_env)
                    if out_stack == old_stack and out_env == old_env:
                        continue
                entry[j] = (out_stack, out_env)
                todo.append(j)
            returned |= step.returned
            parts |= step.parts
            fields |= step.fields
        if depth == 0:
            self.output_parts |= parts
            self.output_fields |= fields
        return Returned(returned, parts, fields)

    def call(
        self, code: types.CodeType, scope: Scope, env: Env, context: tuple[list[Guard], list[str]], depth: int
    ) -> Returned:
        """Analyse code called from the body (a comprehension, lambda or helper) in place: the sources of what
        it returns, the calls whose results it returns unchanged, and the fields that hold them."""
        if depth >= MAX_DEPTH:
            return NOTHING
        key = (code, tuple(sorted((k, v.taint, id(v.obj)) for k, v in env.items())), tuple(context[1]), depth)
        if key in self._memo:
            return self._memo[key]
        self._memo[key] = NOTHING  # recursion guard
        body = tuple(Bytecode.from_code(code))
        comprehension = code.co_name in ("<listcomp>", "<setcomp>", "<dictcomp>", "<genexpr>")
        result = self.run(body, scope, env, code.co_filename, context, depth=depth + 1, comprehension=comprehension)
        self._memo[key] = result
        return result


class _Step:
    """Interprets one element of a body: its effect on stack and variables, and where control goes."""

    def __init__(
        self,
        analysis: _Analysis,
        shape: ControlFlow,
        scope: Scope,
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
        self.returned: frozenset[str] = EMPTY
        self.parts: frozenset[str] = EMPTY  # the `parts` of what it returns
        self.fields: frozenset[tuple[str, str]] = frozenset()  # and its `fields`
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
                self.fields |= value.fields
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
        cond = stack[-1].taint if stack else EMPTY
        self.conditions[i] = self.conditions.get(i, EMPTY) | cond
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
            self.env[name_of(e.arg)] = Value(value.taint, value.obj, parts=value.parts, fields=value.fields, keys=value.keys)
        elif name in ("DELETE_NAME", "DELETE_FAST", "DELETE_DEREF"):
            self.env.pop(name_of(e.arg), None)
        elif name == "LOAD_CONST":
            stack.append(Value(obj=CodeRef(e.arg) if isinstance(e.arg, types.CodeType) else None, keys=constant_keys(e.arg)))
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
            self.fields |= value.fields
        else:
            self._generic(e, stack)

    def _attribute(self, e: Instr, stack: list[Value]) -> None:
        owner = stack.pop() if stack else Value()
        attr = name_of(e.arg)
        obj: Any = None
        if isinstance(owner.obj, Component) and attr in make_methods(type(owner.obj)):
            obj = MakeRef(owner.obj, attr, owner.origin or type(owner.obj).__name__.lower())
        elif isinstance(owner.obj, SuperRef):
            obj = owner.obj.lookup(attr)
        elif owner.obj is not None and not isinstance(owner.obj, type) and hasattr(owner.obj, "__dict__"):
            obj = vars(owner.obj).get(attr)  # modules and plain instances; no descriptors run
            if obj is None and not isinstance(owner.obj, (types.ModuleType, Component)):
                obj = bind(inspect.getattr_static(type(owner.obj), attr, None), owner.obj)  # a method
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
            obj = SuperRef(popped[1].obj, popped[2].obj).lookup(name_of(e.arg))
        stack += [Value(union(popped), obj)] * pushes

    def _generic(self, e: Instr, stack: list[Value]) -> None:
        pops, pushes = pops_pushes(e)
        popped = stack[len(stack) - pops :] if pops else []
        del stack[len(stack) - len(popped) :]
        if e.name in _ADDS and stack:
            # comprehension results and `x += [...]`-style updates derive from what is added
            target = len(stack) - int(e.arg)
            if 0 <= target < len(stack):
                stack[target] = Value(stack[target].taint | union(popped), stack[target].obj, stack[target].origin)
        if e.name in ("STORE_SUBSCR", "STORE_ATTR") and len(popped) >= 2:
            container = popped[1] if e.name == "STORE_SUBSCR" else popped[-1]
            absorb(self.env, container.origin, popped[0].taint)
        code = next((v.obj for v in popped if isinstance(v.obj, CodeRef)), None)
        keep_code = e.name in ("MAKE_FUNCTION", "SET_FUNCTION_ATTRIBUTE")
        parts = frozenset().union(*(v.parts for v in popped)) if e.name in _BUILDS else EMPTY
        fields = dict_fields(e.name, popped)
        stack += [Value(union(popped), code if keep_code else None, parts=parts, fields=fields)] * pushes

    def _context_at(self, i: int) -> tuple[list[Guard], list[str]]:
        guards = list(self.context[0])
        for b in sorted(self.shape.controls.get(i, ())):
            kind, line = self.shape.guard_kind(b)
            if all((g.kind, g.lineno) != (kind, line) for g in guards):
                guards.append(Guard(kind, line, self.conditions.get(b, EMPTY)))
        for line in self.shape.excepts.get(i, ()):
            if all((g.kind, g.lineno) != ("except", line) for g in guards):
                guards.append(Guard("except", line, EMPTY))
        loops = list(self.context[1]) + [x for x in self.shape.loops.get(i, []) if x not in self.context[1]]
        return guards, loops

    def _call(self, i: int, e: Instr, stack: list[Value]) -> None:
        pops, _ = pops_pushes(e)
        popped = stack[len(stack) - pops :]
        del stack[len(stack) - len(popped) :]
        ref = next((v.obj for v in popped[:2] if is_callable_ref(v.obj)), None)
        args = [v for v in popped if v.obj is not ref or ref is None]
        taint = union(args)
        if isinstance(ref, MakeRef):
            node = frozenset({self._node(i, e, ref, taint)})
            stack.append(Value(node, parts=node))
            return
        if len(popped) == 4 and any(v.obj is builtins.super for v in popped[:2]) and isinstance(popped[2].obj, type):
            stack.append(Value(taint, SuperRef(popped[2].obj, popped[3].obj)))  # super(cls, self)
            return
        result, parts, fields = taint, EMPTY, frozenset[tuple[str, str]]()
        if ref is not None:  # a helper returning a call's result as it is returns a part of what it is given
            returned, parts, fields = self._enter(i, ref, taint, *self._arguments(i, e, popped))
            result |= returned
        for v in args:  # a lambda or helper passed as an argument runs with the other arguments
            if isinstance(v.obj, CodeRef) or is_user_function(v.obj):
                result |= self._enter(i, v.obj, taint)[0]
        receiver = popped[1] if len(popped) > 1 else Value()
        absorb(self.env, receiver.origin, taint - receiver.taint)
        stack.append(Value(result, parts=parts, fields=fields))

    def _arguments(self, i: int, e: Instr, popped: list[Value]) -> tuple[list[Value], dict[str, Value]]:
        """The positional and keyword arguments of a call (after the callable and its self-or-NULL slot), the
        keywords named by the KW_NAMES before a CALL (3.11, 3.12) or the constant tuple a CALL_KW pops (3.13);
        none for `f(*args, **kwargs)`, where which parameter a value binds to is not known here."""
        if e.name not in ("CALL", "CALL_KW"):
            return [], {}
        k = i - 1
        while k >= 0 and isinstance(self.shape.body[k], Instr) and self.shape.body[k].name == "PRECALL":  # 3.11
            k -= 1
        before = self.shape.body[k] if k >= 0 else None
        names: tuple[str, ...] = ()
        if isinstance(before, Instr) and before.name == ("KW_NAMES" if e.name == "CALL" else "LOAD_CONST"):
            if not isinstance(before.arg, tuple):
                return [], {}
            names = before.arg
        elif e.name == "CALL_KW":
            return [], {}
        args = popped[2:-1] if e.name == "CALL_KW" else popped[2:]
        split = len(args) - len(names)
        return args[:split], dict(zip(names, args[split:]))

    def _enter(
        self,
        i: int,
        ref: Any,
        taint: frozenset[str],
        positional: list[Value] | None = None,
        keywords: dict[str, Value] | None = None,
    ) -> Returned:
        if isinstance(ref, CodeRef):
            code = ref.code
            scope = Scope(False, self.scope.globals, outer=self.scope, outer_env=dict(self.env))
        else:
            fn = getattr(ref, "__func__", ref)
            code = fn.__code__
            closure = fn.__closure__ or ()
            scope = Scope(False, fn.__globals__, cells=dict(zip(code.co_freevars, (c.cell_contents for c in closure))))
        nparams = code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & 0x4) + bool(code.co_flags & 0x8)
        env = {param: Value(taint) for param in code.co_varnames[:nparams]}
        first = 0
        if isinstance(ref, types.MethodType) and code.co_argcount:  # a method: its `self` is known
            env[code.co_varnames[0]] = Value(taint, ref.__self__)
            first = 1
        if not isinstance(ref, CodeRef):  # a component passed to a helper is that component inside it
            for param, arg in zip(code.co_varnames[first : code.co_argcount], positional or []):
                env[param] = Value(taint, arg.obj)
            for param, arg in (keywords or {}).items():
                if param in code.co_varnames[first:nparams]:
                    env[param] = Value(taint, arg.obj)
        return self.analysis.call(code, scope, env, self._context_at(i), self.depth)

    def _node(self, i: int, e: Instr, ref: MakeRef, taint: frozenset[str]) -> str:
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
    scope = Scope(module_level, module_globals)
    body = tuple(_as_cell(e) for e in block.body)
    returned = analysis.run(body, scope, variables, block.filename, ([], []), output).sources
    graph.name_held()
    for src in sorted(returned):
        graph.add_edge(src, OUTPUT, "data", PART if src in analysis.output_parts else "")
    graph.set_output_fields((key, node) for key, node in analysis.output_fields if node in analysis.output_parts)
    return graph


def _as_cell(e: Any) -> Any:
    if isinstance(e, Instr) and isinstance(e.arg, FreeVar):
        return Instr(e.name, CellVar(e.arg.name), location=e.location)
    return e
