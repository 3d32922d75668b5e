"""The walk an identity is made of (`patchkit.program.identity`): a stable digest of any value, and of the code it
reads, followed as far as the user's own code goes.

A `Walk` digests a component (its class's attributes, its constructor arguments, the files it names and the
version it declares) or any value, and records a labelled part for each global and helper the code it meets
reads: `helper fmt`, `module constant TEMPLATE`, `helper prompts.fmt` for a helper reached through a module
of the user's. The user's own code is followed into; the standard library's, patchkit's and an installed
distribution's count by their names (`users_module`: decided by the module's name and the distributions'
metadata, never by where a file happens to live).

Values digest by a canonical encoding of what they hold, never `repr` (which elides and prints addresses):
plain values by their exact text or bits, buffers (bytes, numpy arrays) by a hash of their content, other
objects by what pickling them keeps. A `Memo` keeps the digests of large values for one computation of
versions, so that a value many components hold is read once.
"""

from __future__ import annotations

import dis
import hashlib
import logging
import types
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

from patchkit.core import Component
from patchkit.program.files import files_digest
from patchkit.program.origin import users_module

__all__ = ["Memo", "Walk", "code_digest", "parts_digest"]

logger = logging.getLogger(__name__)

# What a class's namespace holds that is no behaviour of it: its docs, where it was written, its slots' machinery.
_NOT_BEHAVIOUR = frozenset({"__doc__", "__module__", "__qualname__", "__dict__", "__weakref__", "__firstlineno__",
                            "__static_attributes__", "__annotations__", "__orig_bases__", "__parameters__"})
_GLOBAL_OPS = frozenset(dis.opmap[name] for name in ("LOAD_GLOBAL", "LOAD_NAME", "STORE_GLOBAL", "DELETE_GLOBAL"))
_LOAD_GLOBAL_OPS = frozenset(dis.opmap[name] for name in ("LOAD_GLOBAL", "LOAD_NAME"))
_ATTRIBUTE_OPS = frozenset(dis.opmap[name] for name in ("LOAD_ATTR", "LOAD_METHOD") if name in dis.opmap)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis), type(NotImplemented))
_PLAIN_TYPES = frozenset(_PLAIN)  # exactly these (a subclass may hold more than its value)
_BUILTIN_CALLABLES = (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
                      types.MethodDescriptorType, types.ClassMethodDescriptorType)
_MAX_DEPTH = 64  # a value nested deeper is digested by its type
_MEMO_BYTES = 1 << 16  # values this large are digested once per `Memo`, however often they are met


class Memo:
    """The large values (texts, lists, buffers) digested so far in one computation of versions, by object: each
    is read once however many components and pipelines hold it. Holds them until it is dropped (one `stamp`)."""

    def __init__(self) -> None:
        self._digests: dict[int, tuple[Any, bytes]] = {}

    def get(self, value: Any) -> bytes | None:
        found = self._digests.get(id(value))
        return found[1] if found is not None and found[0] is value else None

    def put(self, value: Any, digest: bytes) -> None:
        self._digests[id(value)] = (value, digest)


def parts_digest(parts: Mapping[str, str]) -> str:
    """One digest of labelled parts: equal for equal parts, in any process (an identity's)."""
    whole = hashlib.sha256()
    for label, part in sorted(parts.items()):
        whole.update(f"{label}\0{part}\0".encode())
    return whole.hexdigest()[:16]


def code_digest(code: types.CodeType) -> bytes:
    """What a code object computes: its bytecode, names and constants, nested code objects the same way; each
    part length-prefixed (never marshal, whose output depends on which strings are shared)."""
    consts = [_constant(c) for c in code.co_consts]
    names = [_hash(*names) for names in (code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)]
    return _hash(code.co_code, *names, _hash(*consts), getattr(code, "co_exceptiontable", b""))


def _constant(value: Any) -> bytes:
    """A constant as the digest reads it: code by its digest, plain data by its value, anything else (a function a
    rewritten program holds) by its qualified name, never its address."""
    if isinstance(value, types.CodeType):
        return _hash("code", code_digest(value))
    if isinstance(value, (tuple, frozenset)):
        items = [_constant(v) for v in value]
        return _hash(type(value).__name__, *(sorted(items) if isinstance(value, frozenset) else items))
    if type(value) in _PLAIN_TYPES:
        return _hash(type(value).__name__, _plain(value))
    return _hash("named", f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}")


def _plain(value: Any) -> bytes:
    """A plain value's canonical bytes: text as UTF-8, numbers by their exact digits or bits."""
    kind = type(value)
    if kind is str:
        return value.encode("utf-8", "surrogatepass")
    if kind is bytes:
        return value
    if kind is int or kind is bool:
        return b"%x" % value  # hexadecimal: an integer of any size (decimal text is capped)
    if kind is float:
        return value.hex().encode()
    if kind is complex:
        return f"{value.real.hex()} {value.imag.hex()}".encode()
    return kind.__name__.encode()  # None, Ellipsis, NotImplemented


@lru_cache(maxsize=4096)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The global names `code` (and the code nested in it: lambdas, comprehensions, inner functions) reads or
    writes, in the order they appear."""
    names = [i.argval for i in dis.get_instructions(code) if i.opcode in _GLOBAL_OPS]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return tuple(dict.fromkeys(names))


@lru_cache(maxsize=4096)
def _attribute_chains(code: types.CodeType) -> tuple[tuple[str, ...], ...]:
    """The attributes `code` (and the code nested in it) reads off a global, as `("prompts", "fmt")` for
    `prompts.fmt(q)` and `("pkg", "sub", "CONST")` for `pkg.sub.CONST`: how a helper of a module is reached."""
    chains: list[tuple[str, ...]] = []
    chain: list[str] = []
    for instruction in dis.get_instructions(code):
        if instruction.opcode in _ATTRIBUTE_OPS and chain:
            chain.append(instruction.argval)
            continue
        if len(chain) > 1:
            chains.append(tuple(chain))
        chain = [instruction.argval] if instruction.opcode in _LOAD_GLOBAL_OPS else []
    if len(chain) > 1:
        chains.append(tuple(chain))
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            chains += _attribute_chains(const)
    return tuple(dict.fromkeys(chains))


def _qualified(value: Any) -> str:
    kind = value if isinstance(value, type) else type(value)
    return f"{getattr(value, '__module__', kind.__module__)}.{getattr(value, '__qualname__', kind.__qualname__)}"


def _hash(*parts: bytes | str) -> bytes:
    digest = hashlib.sha256()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        digest.update(len(data).to_bytes(8, "little") + data)
    return digest.digest()


class Walk:
    """One identity's walk: `parts` by label, each thing read once (a cycle is cut where it closes); `memo`, the
    large values digested already, shared by the walks of one `stamp`."""

    def __init__(self, home: str, memo: Memo | None = None) -> None:
        self.home = home  # the module whose globals are named without it
        self.memo = memo if memo is not None else Memo()
        self.parts: dict[str, str] = {}
        self._open: set[int] = set()  # objects being digested: met again inside themselves, a cycle
        self._known: dict[int, bytes] = {}  # the classes and functions digested already, kept alive by the value read

    # -- parts ------------------------------------------------------------------------------------------------
    def component(self, component: Component) -> None:
        spec = component._patchkit_spec
        for cls in spec.cls.__mro__:
            if cls is object or cls.__module__.startswith("patchkit."):
                continue  # Component and the built-in components' bases count by name, below
            if not users_module(cls.__module__):
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
        self.declared(component)

    def declared(self, component: Component) -> None:
        """The parts a component states itself: the files it reads, and a version of what no digest sees."""
        try:
            files = list(component.version_files())
        except Exception as exc:  # noqa: BLE001 - the component's own code: its version is the rest
            logger.warning("%r.version_files() raised (%s): its version leaves its files out", component, exc)
            files = []
        if files:
            self.parts["files read"] = files_digest(files)
        version = getattr(component, "version", None)
        if version is not None and not callable(version):
            self.parts["declared version"] = self.value(version).hex()

    def attribute(self, label: str, value: Any) -> None:
        """A class attribute: a method by its code, its default arguments a part of their own; else its value."""
        function = _function_of(value)
        if function is None or not users_module(_module_of(function)):
            self.parts[label] = self.value(value).hex()
            return
        self.parts[label] = _hash(self.value(value, defaults=False), self._options(value)).hex()
        if function.__defaults__ or function.__kwdefaults__:
            self.parts[f"{label} default arguments"] = self._defaults(function).hex()

    def globals_read(self, code: types.CodeType, namespace: Mapping[str, Any], module: str) -> None:
        """A part for each global of `namespace` that `code` reads (helpers and constants of the user's modules),
        and for each attribute it reads off a module of the user's (`prompts.fmt`)."""
        for name in _global_names(code):
            if name in namespace:  # else a builtin
                self._part(f"{_kind(namespace[name])} {self._named(module, name)}", namespace[name])
        for first, *attributes in _attribute_chains(code):
            found = namespace.get(first)
            path = self._named(module, first)
            for attribute in attributes:
                if not isinstance(found, types.ModuleType) or not users_module(found.__name__):
                    break
                found, path = _attribute(found, attribute), f"{path}.{attribute}"
                if found is not None and not isinstance(found, types.ModuleType):
                    self._part(f"{_kind(found)} {path}", found)

    def _named(self, module: str, name: str) -> str:
        return name if module == self.home else f"{module}.{name}"

    def _part(self, label: str, value: Any) -> None:
        if label in self.parts:
            return
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
        kind = type(value)
        if kind in _PLAIN_TYPES and (kind not in (str, bytes) or len(value) < _MEMO_BYTES):
            return _hash(kind.__name__, _plain(value))
        if (known := self.memo.get(value)) is not None:
            return known
        if kind in _PLAIN_TYPES or (kind in (tuple, list) and _all_plain(value)):
            return self._remember(value, _plain_digest(value))  # the common case, digested at once
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

    def _remember(self, value: Any, digest: bytes) -> bytes:
        if _size(value) >= _MEMO_BYTES:
            self.memo.put(value, digest)
        return digest

    def _value(self, value: Any, depth: int, defaults: bool) -> bytes:
        if isinstance(value, (tuple, list)):
            return self._remember(value, _hash(type(value).__name__, *(self.value(v, depth) for v in value)))
        if isinstance(value, dict):
            return _hash("dict", *(_hash(self.value(k, depth), self.value(v, depth)) for k, v in value.items()))
        if isinstance(value, (set, frozenset)):
            return _hash(type(value).__name__, *sorted(self.value(v, depth) for v in value))
        if isinstance(value, Component):
            walk = Walk(type(value).__module__, self.memo)
            walk._open = self._open
            walk.component(value)
            return _hash("component", parts_digest(walk.parts))
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
        if (buffer := _buffer_digest(value)) is not None:
            extra = self.value(vars(value), depth) if hasattr(value, "__dict__") else b""
            return self._remember(value, _hash(buffer, extra))
        return self._object(value, depth)

    def _function(self, function: types.FunctionType, depth: int, defaults: bool) -> bytes:
        module = _module_of(function)
        if not users_module(module):  # by name; a decorator's wrapper with what it wraps
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
        if not users_module(cls.__module__):
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


def _plain_digest(value: Any) -> bytes:
    """A plain value, or a list or tuple of plain values, in one pass: each item's type, length and bytes."""
    digest = hashlib.sha256(type(value).__name__.encode() + b"\0")
    for item in value if type(value) in (tuple, list) else (value,):
        data = _plain(item)
        digest.update(b"%s:%d:" % (type(item).__name__.encode(), len(data)))
        digest.update(data)
    return digest.digest()


def _buffer_digest(value: Any) -> bytes | None:
    """An object that exports a buffer (an array, a bytearray) by its type, layout and a hash of its content,
    read in place; None for any other object."""
    try:
        view = memoryview(value)
    except (TypeError, ValueError):  # no buffer, or one of objects (an array of dtype object): read as pickled
        return None
    with view:
        layout = f"{_qualified(value)} {getattr(value, 'dtype', '')} {view.format} {view.itemsize} {view.shape}"
        digest = hashlib.sha256(layout.encode() + b"\0")
        digest.update(view.cast("B") if view.c_contiguous else view.tobytes())
    return digest.digest()


def _size(value: Any) -> int:
    """About how many bytes digesting `value` reads: its length for texts and buffers, its items for a list."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (tuple, list)):
        return len(value) * 256
    return getattr(value, "nbytes", 0) or 0


def _attribute(module: types.ModuleType, name: str) -> Any:
    """`module.name` as its namespace holds it (no module `__getattr__` runs); None where it has none."""
    return vars(module).get(name)


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

