"""Objects that hold components: what a pipeline binds by identity besides components themselves.

A name the block reads may hold components in its attributes or items: `self.retriever` in a
method, `tools["web"]` in a dict of tools, a captured Pipeline's own components. Capture binds such
an object by identity (it is never an input, never copied per run), and the graph registers every
component it holds, so each one gets workers when deployed, whether or not the capture run called it.

An object may name its components itself with a `__patchkit_components__()` method returning a
mapping of names to components (a Pipeline does); the walk then takes those and nothing else of it.
Otherwise the walk reads instance `__dict__`s and the items of lists, tuples, sets and dicts, through their
base-class methods: no property, descriptor or iterator of the user's runs. It never enters a
component (a component's own components run inside its worker), a module, a class, a function or
a module's namespace, and it stops at `MAX_DEPTH` levels and `MAX_OBJECTS` objects.
"""

from __future__ import annotations

import inspect
import itertools
import types
from collections import deque
from collections.abc import Iterator
from typing import Any

from patchkit.core import Component

__all__ = ["MAX_DEPTH", "MAX_OBJECTS", "constructor_components", "given_components", "held_components", "holds_components"]

MAX_DEPTH = 4
MAX_OBJECTS = 10_000


def holds_components(value: Any) -> bool:
    """True when a component is reachable from `value` (a component itself included)."""
    return bool(held_components(value, "_"))


def held_components(value: Any, name: str) -> list[tuple[str, Component]]:
    """The components reachable from `value`, bound to `name`, each with a display name.

    Breadth first, so the shortest path names a component: an attribute or a string key that is
    an identifier names it (`self.retriever` -> "retriever", `tools["web"]` -> "web"); an item of
    a list, tuple or set is named after its container and position (`llms[1]` -> "llms_1").
    """
    found: list[tuple[str, Component]] = []
    seen: set[int] = set()
    todo: deque[tuple[Any, str, int]] = deque([(value, name, 0)])
    while todo and len(seen) < MAX_OBJECTS:
        obj, label, depth = todo.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Component):
            found.append((label, obj))
            continue
        if depth >= MAX_DEPTH:
            continue
        room = max(MAX_OBJECTS - len(seen) - len(todo), 0)
        children = itertools.islice(_children(obj, label), room)
        todo.extend((child, child_label, depth + 1) for child, child_label in children)
    return found


def given_components(component: Component) -> list[Component]:
    """Every component passed to `component`'s constructor (those its class runs in place too), each once."""
    return list({id(inner): inner for _, inner in _arguments(component, in_place=True)}.values())


def constructor_components(component: Component) -> list[tuple[str, Component]]:
    """The components passed to `component`'s constructor, found in its recorded arguments as
    `held_components` finds them, each named after its parameter (`Grader(llm)` -> "generator"),
    but for the parameters its class runs in place (`Component.in_place`). A deployment serves each
    on its own and the holder calls it there (a shared component)."""
    return list(_arguments(component, in_place=False))


def _arguments(component: Component, *, in_place: bool) -> Iterator[tuple[str, Component]]:
    """The components in `component`'s recorded constructor arguments, named as `held_components` names
    them; those of the parameters its class runs in place only when `in_place`."""
    spec = component._patchkit_spec
    skipped = () if in_place else type(component).in_place
    for name, value in [*zip(spec.parameter_names(), spec.args), *spec.kwargs.items()]:
        if name not in skipped:
            yield from ((label, inner) for label, inner in held_components(value, name or "arg") if inner is not component)


def _children(obj: Any, label: str) -> Iterator[tuple[Any, str]]:
    if isinstance(obj, (str, bytes, int, float, complex, bool, type(None))):
        return iter(())
    if isinstance(obj, dict):
        if "__builtins__" in obj:  # a module's namespace: the globals of some code, not data
            return iter(())
        return ((v, _key_label(k, label, i)) for i, (k, v) in enumerate(dict.items(obj)))
    if isinstance(obj, (list, tuple)):
        items = list.__iter__(obj) if isinstance(obj, list) else tuple.__iter__(obj)
        return ((v, f"{label}_{i}") for i, v in enumerate(items))
    if isinstance(obj, (set, frozenset)):
        members = set.__iter__(obj) if isinstance(obj, set) else frozenset.__iter__(obj)
        components = sorted((v for v in members if isinstance(v, Component)), key=lambda c: c._patchkit_spec.uid)
        return ((v, f"{label}_{i}") for i, v in enumerate(components))
    if isinstance(obj, (type, types.ModuleType, types.CodeType, types.FrameType)) or inspect.isroutine(obj):
        return iter(())
    declared = getattr(type(obj), "__patchkit_components__", None)
    if declared is not None:
        return ((v, k) for k, v in declared(obj).items())
    try:
        state = object.__getattribute__(obj, "__dict__")
    except AttributeError:
        return iter(())
    if not isinstance(state, dict):
        return iter(())
    return ((v, _attribute_label(k, label)) for k, v in dict.items(state) if isinstance(k, str))


def _attribute_label(attr: str, parent: str) -> str:
    bare = attr.lstrip("_")
    return bare if bare.isidentifier() else parent


def _key_label(key: Any, parent: str, index: int) -> str:
    if isinstance(key, str) and key.isidentifier():
        return key
    return f"{parent}_{key if isinstance(key, int) else index}"
