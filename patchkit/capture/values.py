"""The abstract values the data-flow pass (`dataflow.py`) interprets a captured body over.

A `Value` carries the set of sources it derives from (call nodes and `input:<name>`), the object it
is known to be (a Component, a `@make` method as a `MakeRef`, a function, a nested code object as a
`CodeRef`, `super()`'s proxy as a `SuperRef`) and the variable it was loaded from. A `Scope`
resolves a name to a Value in one analysed code object: its variables, closure cells, enclosing
body and globals. `dataflow.py` is the only caller; the values are immutable, environments
(`Env`) are plain dicts joined at control-flow merges.
"""

from __future__ import annotations

import builtins
import os
import sysconfig
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from patchkit.core import Component

__all__ = [
    "EMPTY",
    "CodeRef",
    "Env",
    "MakeRef",
    "Scope",
    "SuperRef",
    "Value",
    "absorb",
    "bind",
    "constant_keys",
    "dict_fields",
    "is_callable_ref",
    "is_user_function",
    "join_env",
    "merge",
    "union",
]

EMPTY: frozenset[str] = frozenset()
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_PATCHKIT_DIR = str(Path(__file__).resolve().parents[1]) + os.sep


@dataclass(frozen=True)
class MakeRef:
    """A `@make` method of a component, as loaded: calling it makes a graph node."""

    component: Component
    method: str
    name: str


@dataclass(frozen=True)
class CodeRef:
    """A nested code object (comprehension, lambda, inner function), analysed in place when called."""

    code: types.CodeType


@dataclass(frozen=True, eq=False)
class SuperRef:
    """`super(cls, obj)`: its attributes are looked up on obj's class after cls."""

    cls: type
    obj: Any

    def lookup(self, attr: str) -> Any:
        mro = type(self.obj).__mro__
        after = mro[mro.index(self.cls) + 1 :] if self.cls in mro else ()
        for klass in after:
            if attr in vars(klass):
                return bind(vars(klass)[attr], self.obj)
        return None


def bind(attr: Any, obj: Any) -> Any:
    """A plain function found on a class, bound to `obj` as a method; anything else, None."""
    return types.MethodType(attr, obj) if isinstance(attr, types.FunctionType) else None


@dataclass(frozen=True)
class Value:
    taint: frozenset[str] = EMPTY
    obj: Any = None
    origin: str | None = None
    # The call nodes whose very result this value is, or holds as an item of a list, tuple or dict built
    # from it: a streaming call among them makes (part of) the output as it is, so its chunks may stream.
    parts: frozenset[str] = EMPTY
    # For a dict built with constant string keys: (key, call node) for each of `parts` that is a key's value,
    # so that a dict output's fields are known by the calls that make them.
    fields: frozenset[tuple[str, str]] = frozenset()
    keys: str | tuple[str, ...] | None = None  # a string constant, or a tuple of them (a dict display's keys)

    def join(self, other: Value) -> Value:
        same = self.obj is other.obj or (isinstance(self.obj, (MakeRef, CodeRef)) and self.obj == other.obj)
        obj = self.obj if same else None
        origin = self.origin if self.origin == other.origin else None
        keys = self.keys if self.keys == other.keys else None
        return Value(self.taint | other.taint, obj, origin, self.parts | other.parts, self.fields | other.fields, keys)


def union(values: list[Value]) -> frozenset[str]:
    """The sources of all `values` together."""
    return frozenset().union(*(v.taint for v in values)) if values else EMPTY


Env = dict[str, Value]


@dataclass
class Scope:
    """Name resolution for one analysed code object: its globals, closure cells and enclosing scope.

    Variables live in the flow-sensitive environment of each program point, not here; `outer_env`
    is the enclosing body's environment where the nested code was called.
    """

    module_level: bool
    globals: Mapping[str, Any]
    outer: Scope | None = None
    outer_env: Env = field(default_factory=dict)
    cells: Mapping[str, Any] = field(default_factory=dict)

    def load(self, env: Env, op: str, name: str) -> Value:
        if op == "LOAD_GLOBAL" and not self.module_level:
            if self.outer is not None and self.outer.module_level:
                return self.outer.load(self.outer_env, "LOAD_NAME", name)
            return Value(obj=self.globals.get(name, _builtin(name)), origin=name)
        if name in env:
            found = env[name]
            return Value(found.taint, found.obj, name, found.parts, found.fields, found.keys)
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


def absorb(env: Env, name: str | None, taint: frozenset[str]) -> None:
    """A method call or item store on a variable's value mutates it: the variable gains taint."""
    if name is not None and name in env and not taint <= env[name].taint:
        old = env[name]
        env[name] = Value(old.taint | taint, old.obj)


def join_env(a: Env, b: Env) -> Env:
    """Two environments where control flow meets: each variable's values joined."""
    out = dict(a)
    for name, value in b.items():
        out[name] = value if name not in out else out[name].join(value)
    return out


def merge(a: tuple[Value, ...], b: tuple[Value, ...]) -> tuple[Value, ...]:
    """Two operand stacks where control flow meets, joined slot by slot."""
    return tuple(x.join(y) for x, y in zip(a, b))


def is_user_function(fn: Any) -> bool:
    """A function of the user's own code: neither the standard library's, an installed package's nor patchkit's."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return False
    path = code.co_filename
    return not (path.startswith(_LIBRARY_DIRS) or path.startswith("<frozen") or path.startswith(_PATCHKIT_DIR))


def is_callable_ref(obj: Any) -> bool:
    """What the pass enters on a call: a `@make` method, nested code or a user function."""
    return isinstance(obj, (MakeRef, CodeRef)) or is_user_function(obj)


def constant_keys(constant: Any) -> str | tuple[str, ...] | None:
    """A constant that may be a dict display's keys: a string, or a tuple of strings."""
    if isinstance(constant, str) or (isinstance(constant, tuple) and all(isinstance(k, str) for k in constant)):
        return constant
    return None


def dict_fields(op: str, popped: list[Value]) -> frozenset[tuple[str, str]]:
    """(key, call node) for each value of a dict display with string constant keys that is a call's result."""
    if op == "BUILD_CONST_KEY_MAP" and popped and isinstance(popped[-1].keys, tuple):
        pairs = list(zip(popped[-1].keys, popped[:-1]))
    elif op == "BUILD_MAP":
        pairs = [(k.keys, v) for k, v in zip(popped[::2], popped[1::2]) if isinstance(k.keys, str)]
    else:
        return frozenset()
    return frozenset((key, node) for key, value in pairs if isinstance(key, str) for node in value.parts)
