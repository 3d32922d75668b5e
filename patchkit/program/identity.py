"""Which components are the same: one name per component across several pipelines, and a component's
identity (everything its behaviour depends on), which says whether a component of a new version of a
pipeline can keep the workers of one already deployed.

A component object several pipelines use is one component, deployed once (`deployed_names`). Two objects
of one identity build the same component in a worker: a component an update left as it was (made again by
a script run again) is the one deployed, and keeps its workers, their queues and caches.

An identity is a map of parts, each what one thing the component's code reads digests to: each attribute
of its class and of its bases (methods by their code, their default arguments apart, constants by their
values), each module global and helper its code reads (followed through the helpers' own code, closures
and nested functions included, as far as the user's own modules go: an installed package's function, the
standard library's and patchkit's count by their names), and its constructor arguments. The parts that
differ between two identities say what changed (`Identity.changes`). Line numbers, file names and memory
addresses are never read: a blank line or a comment changes nothing, and one source makes one identity in
every process.
"""

from __future__ import annotations

import dis
import hashlib
import logging
import marshal
import os
import site
import sys
import sysconfig
import types
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from patchkit.core import Component

__all__ = ["Identity", "code_digest", "deployed_name", "deployed_names", "fingerprint", "identity", "program_identity"]

logger = logging.getLogger(__name__)

# What a class's namespace holds that is no behaviour of it: its docs, where it was written, its slots' machinery.
_NOT_BEHAVIOUR = frozenset({"__doc__", "__module__", "__qualname__", "__dict__", "__weakref__", "__firstlineno__",
                            "__static_attributes__", "__annotations__", "__orig_bases__", "__parameters__"})
_GLOBAL_OPS = frozenset(dis.opmap[name] for name in ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"))
_PLAIN = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), type(NotImplemented))
_PLAIN_TYPES = frozenset(_PLAIN)  # exactly these (a subclass's repr may be anything)
_BUILTIN_CALLABLES = (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
                      types.MethodDescriptorType, types.ClassMethodDescriptorType)
_MAX_DEPTH = 64  # a value nested deeper is digested by its type


def deployed_names(pipelines: Mapping[str, Mapping[str, Component]]) -> dict[str, Component]:
    """The components of several pipelines (by pipeline name, each its components by name), one entry per
    component object, under the first pipeline's name for it; a name another object took already is
    `pipeline/name` (`deployed_name`)."""
    named: dict[str, Component] = {}
    seen: set[str] = set()
    for pipeline, components in pipelines.items():
        for name, component in components.items():
            if (uid := component._patchkit_spec.uid) not in seen:
                seen.add(uid)
                named[deployed_name(name, pipeline, 1, named)] = component
    return named


def deployed_name(name: str, pipeline: str, version: int, taken: Container[str]) -> str:
    """The name a pipeline's component `name` is deployed under: its own, else (another component has it) for a
    later version of the pipeline `name@v<version>`, else `pipeline/name`, else `pipeline/name@v<version>`."""
    later = version > 1
    candidates = [name, f"{name}@v{version}" if later else None, f"{pipeline}/{name}", f"{pipeline}/{name}@v{version}"]
    return next(c for c in candidates if c is not None and c not in taken)


@dataclass(frozen=True)
class Identity:
    """What a component (or a pipeline's own code) is: a digest per part, by what the part is, as
    `Gen.PROMPT`, `Gen.generate`, `Gen.generate default arguments`, `module constant TEMPLATE`, `helper fmt`,
    `constructor arguments`."""

    parts: Mapping[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """One digest of every part: equal for identities of equal parts, in any process."""
        whole = hashlib.sha256()
        for label, part in sorted(self.parts.items()):
            whole.update(f"{label}\0{part}\0".encode())
        return whole.hexdigest()[:16]

    def changes(self, before: Identity) -> list[str]:
        """The parts that differ from `before`'s (changed, added or gone), sorted; empty for the same identity."""
        labels = set(self.parts) | set(before.parts)
        return sorted(label for label in labels if self.parts.get(label) != before.parts.get(label))


def identity(component: Component) -> Identity:
    """Everything `component`'s behaviour depends on, part by part; see the module's docstring."""
    spec = component._patchkit_spec
    walk = _Walk(spec.cls.__module__)
    walk.component(component)
    return Identity(walk.parts)


def fingerprint(component: Component) -> str:
    """The digest of `component`'s identity: equal for two components a worker builds alike."""
    return identity(component).digest


def program_identity(code: types.CodeType, module_globals: Mapping[str, Any] | None, module_name: str,
                     values: Mapping[str, Any]) -> Identity:
    """A captured body's identity: its `code`, the globals of `module_globals` (its module's, or None) it
    reads, followed as a component's are, and `values` (the objects it is run with) by name. Components
    among them count by their fingerprint."""
    walk = _Walk(module_name)
    walk.parts["pipeline code"] = code_digest(code).hex()
    if module_globals is not None:
        walk.globals_read(code, module_globals, module_name)
    for name, value in sorted(values.items()):
        walk.parts[f"bound {name}"] = walk.value(value).hex()
    return Identity(walk.parts)


def code_digest(code: types.CodeType) -> bytes:
    """What a code object computes: its bytecode, names and constants, nested code objects the same way."""
    consts = tuple(_constant(c) for c in code.co_consts)
    parts = (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, repr(consts),
             getattr(code, "co_exceptiontable", b""))
    return hashlib.sha256(marshal.dumps(tuple(p if not isinstance(p, str) else p.encode() for p in parts))).digest()


def _constant(value: Any) -> Any:
    """A constant as the digest reads it: code by its digest, plain data as it is, anything else (a function a
    rewritten program holds) by its qualified name, never its address."""
    if isinstance(value, types.CodeType):
        return code_digest(value)
    if isinstance(value, (tuple, frozenset)):
        return tuple(_constant(v) for v in value)
    if value is None or isinstance(value, (str, bytes, int, float, complex, type(Ellipsis))):
        return value
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"


@lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names `code` (and the code nested in it: lambdas, comprehensions, inner functions) reads or
    writes, in the order they appear."""
    names = [i.argval for i in dis.get_instructions(code) if i.opcode in _GLOBAL_OPS]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return tuple(dict.fromkeys(names))


def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(getattr(site, "getsitepackages", list)())
    roots.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots)


_INSTALLED = _installed_roots()


def _users(module_name: str | None) -> bool:
    """Whether code of module `module_name` is the user's own, followed into: not patchkit's, the standard
    library's or an installed package's. A module no longer imported (a script run again, a class sent by
    value to another process) is the user's."""
    if not module_name or module_name == "builtins":
        return False
    root = module_name.partition(".")[0]
    if root == "patchkit" or root in sys.stdlib_module_names:
        return False
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None) if module is not None else None
    return file is None or not os.path.realpath(file).startswith(_INSTALLED)


def _qualified(value: Any) -> str:
    kind = value if isinstance(value, type) else type(value)
    return f"{getattr(value, '__module__', kind.__module__)}.{getattr(value, '__qualname__', kind.__qualname__)}"


def _hash(*parts: bytes | str) -> bytes:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.digest()


class _Walk:
    """One identity's walk: `parts` by label, each thing read once (a cycle is cut where it closes)."""

    def __init__(self, home: str) -> None:
        self.home = home  # the module whose globals are named without it
        self.parts: dict[str, str] = {}
        self._open: set[int] = set()  # objects being digested: met again inside themselves, a cycle
        self._known: dict[int, bytes] = {}  # the classes and functions digested already, kept alive by the value read

    # -- parts ------------------------------------------------------------------------------------------------
    def component(self, component: Component) -> None:
        spec = component._patchkit_spec
        for cls in spec.cls.__mro__:
            if cls is object or cls.__module__.startswith("patchkit."):
                continue  # Component and the built-in components' bases count by name, below
            if not _users(cls.__module__):
                self.parts[f"base {_qualified(cls)}"] = _qualified(cls)
                continue
            self.parts[f"class {cls.__qualname__}"] = " ".join(_qualified(c) for c in (cls, *cls.__bases__))
            self._open.add(id(cls))  # met inside itself (`super()`'s cell): by its name, its attributes are parts
            for name, value in sorted(vars(cls).items()):
                if name not in _NOT_BEHAVIOUR:
                    self.attribute(f"{cls.__qualname__}.{name}", value)
        self.parts["class"] = _qualified(spec.cls)
        self._open.add(id(component))
        self.parts["constructor arguments"] = _hash(self.value(spec.args), self.value(spec.kwargs)).hex()

    def attribute(self, label: str, value: Any) -> None:
        """A class attribute: a method by its code, its default arguments a part of their own; else its value."""
        function = _function_of(value)
        if function is None or not _users(_module_of(function)):
            self.parts[label] = self.value(value).hex()
            return
        self.parts[label] = _hash(self.value(value, defaults=False), self._options(value)).hex()
        if function.__defaults__ or function.__kwdefaults__:
            self.parts[f"{label} default arguments"] = self._defaults(function).hex()

    def globals_read(self, code: types.CodeType, namespace: Mapping[str, Any], module: str) -> None:
        """A part for each global of `namespace` that `code` reads: helpers and constants of the user's modules."""
        for name in _global_names(code):
            if name not in namespace:
                continue  # a builtin
            value = namespace[name]
            label = f"{_kind(value)} {name if module == self.home else f'{module}.{name}'}"
            if label in self.parts:
                continue
            self.parts[label] = ""  # met again while digested (a recursive helper): already counted
            self.parts[label] = self.value(value).hex()

    # -- values -----------------------------------------------------------------------------------------------
    def value(self, value: Any, depth: int = 0, *, defaults: bool = True) -> bytes:
        """A stable digest of `value`; a function or class of the user's reads its globals into `parts`."""
        try:
            return self._read(value, depth, defaults)
        except Exception as exc:  # noqa: BLE001 - an object whose attributes raise is still an identity's part
            logger.debug("%s could not be read (%s): an identity counts it by its type only", _qualified(type(value)), exc)
            return _hash("unreadable", _qualified(type(value)))

    def _read(self, value: Any, depth: int, defaults: bool) -> bytes:
        if isinstance(value, _PLAIN):
            return _hash(type(value).__name__, repr(value))
        if type(value) in (tuple, list, dict) and _all_plain(value):
            return _hash(type(value).__name__, "plain", repr(value))  # the common case, digested at once
        if depth > _MAX_DEPTH or id(value) in self._open:
            return _hash("cut", _qualified(value))
        cached = isinstance(value, (type, types.FunctionType)) and defaults  # reads the same everywhere in one walk
        if cached and id(value) in self._known:
            return self._known[id(value)]
        self._open.add(id(value))
        try:
            digest = self._value(value, depth + 1, defaults)
        finally:
            self._open.discard(id(value))
        if cached:
            self._known[id(value)] = digest
        return digest

    def _value(self, value: Any, depth: int, defaults: bool) -> bytes:
        if isinstance(value, (tuple, list)):
            return _hash(type(value).__name__, *(self.value(v, depth) for v in value))
        if isinstance(value, dict):
            return _hash("dict", *(_hash(self.value(k, depth), self.value(v, depth)) for k, v in value.items()))
        if isinstance(value, (set, frozenset)):
            return _hash(type(value).__name__, *sorted(self.value(v, depth) for v in value))
        if isinstance(value, Component):
            walk = _Walk(type(value).__module__)
            walk._open = self._open
            walk.component(value)
            return _hash("component", Identity(walk.parts).digest)
        if isinstance(value, types.ModuleType):
            return _hash("module", value.__name__)
        if isinstance(value, type):
            return self._class(value, depth)
        if isinstance(value, property):
            return _hash("property", *(self.value(f, depth) for f in (value.fget, value.fset, value.fdel)))
        if isinstance(value, types.MethodType):
            return _hash("method", self.value(value.__self__, depth), self.value(value.__func__, depth, defaults=defaults))
        function = _function_of(value)
        if function is not None:
            wrapper = _hash("wrapper", _qualified(value)) if function is not value else b""
            return _hash(wrapper, self._function(function, depth, defaults))
        if isinstance(value, _BUILTIN_CALLABLES):
            return _hash("named", _qualified(value))
        return self._object(value, depth)

    def _function(self, function: types.FunctionType, depth: int, defaults: bool) -> bytes:
        module = _module_of(function)
        if not _users(module):  # by name; a decorator's wrapper with what it wraps
            wrapped = getattr(function, "__wrapped__", None)
            return _hash("function", _qualified(function), b"" if wrapped is None else self.value(wrapped, depth))
        cells = [self.value(_cell(c), depth) for c in function.__closure__ or ()]
        self.globals_read(function.__code__, function.__globals__, module)
        return _hash("function", code_digest(function.__code__), *cells, self._defaults(function) if defaults else b"")

    def _defaults(self, function: types.FunctionType) -> bytes:
        return _hash(self.value(function.__defaults__ or ()), self.value(function.__kwdefaults__ or {}))

    def _options(self, value: Any) -> bytes:
        """The settings a method's decorator object keeps beside the function it wraps (`@make(batch=True)`)."""
        state = getattr(value, "__dict__", None) if not isinstance(value, types.FunctionType) else None
        if not isinstance(state, dict):
            return b""
        plain = {k: v for k, v in state.items() if isinstance(v, _PLAIN) and k not in _NOT_BEHAVIOUR}
        return self.value(dict(sorted(plain.items())))

    def _class(self, cls: type, depth: int) -> bytes:
        if not _users(cls.__module__):
            return _hash("class", _qualified(cls))
        bases = [self.value(base, depth) for base in cls.__bases__]
        members = [_hash(name, self.value(v, depth), self._options(v)) for name, v in sorted(vars(cls).items())
                   if name not in _NOT_BEHAVIOUR]
        return _hash("class", _qualified(cls), *bases, *members)

    def _object(self, value: Any, depth: int) -> bytes:
        """Any other object, by what pickling it would keep (its class and state); by its type where that fails."""
        try:
            reduced = value.__reduce_ex__(4)
        except Exception as exc:  # noqa: BLE001 - an object that refuses to pickle is still an identity's part
            reduced = exc
        if isinstance(reduced, tuple):
            return _hash("object", *(self.value(part, depth) for part in reduced[:3]),
                         *(self.value(list(part), depth) for part in reduced[3:5] if part is not None))
        logger.debug("%s has no stable digest (%s): an identity counts it by its type only", _qualified(value),
                     reduced if isinstance(reduced, Exception) else "it pickles as a name")
        return _hash("object", _qualified(value), str(reduced) if isinstance(reduced, str) else "")


def _all_plain(value: tuple[Any, ...] | list[Any] | dict[Any, Any]) -> bool:
    items = value.items() if isinstance(value, dict) else ((v, None) for v in value)
    return all(type(k) in _PLAIN_TYPES and type(v) in _PLAIN_TYPES for k, v in items)


def _function_of(value: Any) -> types.FunctionType | None:
    """The Python function a method, static or class method, property or decorator object runs."""
    candidates: Iterable[Any] = (value, getattr(value, "__func__", None), getattr(value, "fget", None),
                                 getattr(value, "__wrapped__", None))
    return next((c for c in candidates if isinstance(c, types.FunctionType)), None)


def _module_of(function: types.FunctionType) -> str:
    """The module whose globals `function` reads (a decorator's wrapper copies the `__module__` of what it wraps)."""
    return str(function.__globals__.get("__name__", function.__module__))


def _cell(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return None


def _kind(value: Any) -> str:
    """How a global is named in a change: `helper fmt`, `class Formatter`, `module constant TEMPLATE`..."""
    kind = type(value)  # not `value.__class__`, which a proxy's code answers
    if issubclass(kind, type):
        return "class"
    if issubclass(kind, types.ModuleType):
        return "module"
    if issubclass(kind, Component):
        return "component"
    return "helper" if callable(value) else "module constant"

