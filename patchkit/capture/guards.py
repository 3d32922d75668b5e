"""What may run while a request's calls are open: the checks behind the rewritten code's guards.

Parallel calls keep a window open over code that cannot change what an open call receives, nor see or
cause an effect out of plain Python's order (`capture/overlap.py`). Whether an operator, a truth test, a
format, an attribute read or a builtin's call runs only the interpreter's own code depends on the values
it is given, which only the running request knows: the rewritten code asks these checks first (through
`pending.guard`), and the request's open calls are waited for when the answer is no, so that user code
(a `__lt__`, a `__hash__`, a property, a descriptor's `__get__`, a `__getattr__`, a module's `__getattr__`,
a key function with an effect, a generator) runs where plain Python runs it.

The checks never run user code themselves: they look at `type(value)` and read classes' own namespaces
along their MRO (`lookup`), never `getattr` on a user's object or class. A value is *data* when it is of a
builtin scalar or container type (exactly, not a subclass) whose items are data too, or a class whose
metaclass is `type`. A callable is *safe* when it is a builtin function or a builtin type's method,
`operator.itemgetter`, or a lambda that only reads its arguments and compares.

A check's cost does not grow with the containers it is shown: a container is walked at most once between
two waits of its request (the verdict is kept in the request's `memo`, by identity and length: between
two waits only the request's own guarded code runs, and it changes no container but by code that settles
first), and at most MAX_ITEMS items a check; past that it counts as not data, and the calls are settled.
"""

from __future__ import annotations

import dis
import operator
import sys
import types
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from patchkit.core import MakeMethod

__all__ = ["CHECKS", "INPLACE_OPS", "SHALLOW_OPS", "Memo", "lookup"]



def ids(kinds: Iterable[Any]) -> frozenset[int]:
    """The identities of builtin types (or functions), to test a type against without hashing it: a class's
    hash and `==` are its metaclass's, which may be the user's. They live as long as the interpreter."""
    return frozenset(map(id, kinds))


# Sets of ids: `id(type(x)) in _SCALARS`.
_SCALARS = ids({int, float, complex, bool, str, bytes, type(None), range, slice, type(Ellipsis)})
_LEAVES = _SCALARS | {id(type)}
_CONTAINERS = ids({list, tuple, set, frozenset, dict})
_DATA_TYPES = _LEAVES | _CONTAINERS
_IMMUTABLE = ids({int, float, complex, bool, str, bytes, tuple, frozenset, type(None)})
_BUILTIN_CALLABLES = ids({types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                          types.ClassMethodDescriptorType, operator.itemgetter})
MAX_ITEMS = 10_000  # past this many items a value counts as not data: the calls are settled instead
_MEMO_MIN = 16  # containers this long or longer keep their verdict in the memo


def _binary_op(name: str) -> int:
    """BINARY_OP's argument for the operator `dis` names `name` ("NB_ADD"); an ImportError naming what this
    Python lacks, where it does not name it."""
    names = [entry[0] for entry in getattr(dis, "_nb_ops", ())]
    if name not in names:
        where = "dis._nb_ops does not name it" if names else "it has no dis._nb_ops"
        raise ImportError(f"patchkit's overlap guards need BINARY_OP's operator {name}, and Python "
                          f"{sys.version.split()[0]} does not have it: {where}")
    return names.index(name)


# BINARY_OP's operators, each also in place (`+=`, `&=`, ...).
_OPERATORS = ("ADD", "AND", "FLOOR_DIVIDE", "LSHIFT", "MATRIX_MULTIPLY", "MULTIPLY", "REMAINDER", "OR", "POWER",
              "RSHIFT", "SUBTRACT", "TRUE_DIVIDE", "XOR")
# Those that touch no item of a builtin container (concatenation, repetition, arithmetic: + // << @ * ** >> /);
# the others (`%` formats items, `|`, `&`, `^`, `-` hash them) look at the items too.
SHALLOW_OPS = frozenset(_binary_op("NB_" + name) for name in
                        ("ADD", "FLOOR_DIVIDE", "LSHIFT", "MATRIX_MULTIPLY", "MULTIPLY", "POWER", "RSHIFT", "TRUE_DIVIDE"))
# Each in-place operator's plain one: `x += y` on an immutable `x` is `x + y`.
_PLAIN_OF = {_binary_op("NB_INPLACE_" + name): _binary_op("NB_" + name) for name in _OPERATORS}
INPLACE_OPS = frozenset(_PLAIN_OF)
# Builtins that look at no item of the containers they are given (a length, a copy, a lazy iterator).
_SHALLOW_BUILTINS = ids({len, bool, list, tuple, reversed, enumerate, zip, range})

Memo = dict[int, tuple[Any, int, bool]]
"""A request's verdicts on the containers its checks walked: id -> (the container, its length, is data)."""


# -- reading a class without running its code -------------------------------------------------------------

_MRO = type.__dict__["__mro__"].__get__
_NAMESPACE = type.__dict__["__dict__"].__get__
_MODULE_TYPE: Any = types.ModuleType  # typeshed types a module's `__dict__` as the instance's
_MODULE_DICT = _MODULE_TYPE.__dict__["__dict__"].__get__
_MISSING = object()
_OBJECT_GETATTRIBUTE = object.__dict__["__getattribute__"]
_MODULE_GETATTRIBUTE = _MODULE_TYPE.__dict__["__getattribute__"]
_TYPE_GETATTRIBUTE = type.__dict__["__getattribute__"]
_SLOTS = ids({types.MemberDescriptorType, types.GetSetDescriptorType})  # the interpreter's own data descriptors


def lookup(kind: type, name: str) -> Any:
    """`name` as `kind` finds it along its MRO, read from each class's own namespace, as
    `inspect.getattr_static` does: no descriptor, metaclass or `__getattr__` runs. `_MISSING` if none has it."""
    for k in _MRO(kind):
        found = _NAMESPACE(k).get(name, _MISSING)
        if found is not _MISSING:
            return found
    return _MISSING


def _inherits(kind: type, base: type) -> bool:
    return any(k is base for k in _MRO(kind))


def _data_descriptor(kind: type) -> bool:
    return lookup(kind, "__set__") is not _MISSING or lookup(kind, "__delete__") is not _MISSING


_PLAIN_GETTERS: set[int] = set(ids({types.FunctionType, staticmethod, types.BuiltinFunctionType,
                                     types.MethodDescriptorType, types.WrapperDescriptorType,
                                     types.ClassMethodDescriptorType}))
_FUNCTIONS = ids({types.FunctionType, types.BuiltinFunctionType})


def _plain_get(found: Any) -> bool:
    """Whether reading `found`, a class attribute, runs no user code: a plain value, a function (bound to
    the object), a static or class method of a function, a builtin's method."""
    kind = type(found)
    if lookup(kind, "__get__") is _MISSING or id(kind) in _PLAIN_GETTERS:
        return True
    return kind is classmethod and id(type(found.__func__)) in _FUNCTIONS


def _instance_dict(owner: Any, kind: type) -> dict[str, Any] | None:
    """The object's own namespace, through the interpreter's `__dict__` slot; None where it has none (or the
    class puts something of its own in that place)."""
    slot = lookup(kind, "__dict__")
    if id(type(slot)) not in _SLOTS:
        return None
    try:
        namespace = slot.__get__(owner, kind)
    except AttributeError:
        return None
    return namespace if type(namespace) is dict else None


def allow_descriptor(kind: type) -> None:
    """Count reading attributes that are `kind` descriptors as running no user code (`@make` methods: the
    bound call they make is patchkit's)."""
    _PLAIN_GETTERS.add(id(kind))  # kept alive by the class that uses it


def _attribute(memo: Memo, owner: Any, name: str) -> bool:
    """`owner.name` read: no property, descriptor, `__getattr__`, `__getattribute__` or module `__getattr__`
    of the user's runs."""
    kind = type(owner)
    if id(kind) in _SCALARS or id(kind) in _CONTAINERS:
        return True
    if kind is types.ModuleType:
        namespace = _MODULE_DICT(owner)
        return name in namespace or "__getattr__" not in namespace or lookup(kind, name) is not _MISSING
    if _inherits(kind, type):
        return _class_attribute(owner, kind, name)
    getter = lookup(kind, "__getattribute__")
    if getter is not _OBJECT_GETATTRIBUTE and getter is not _MODULE_GETATTRIBUTE:
        return False
    hook = lookup(kind, "__getattr__") is not _MISSING
    found = lookup(kind, name)
    if found is not _MISSING and _data_descriptor(type(found)):  # the class's wins over the object's
        return id(type(found)) in _SLOTS and (not hook or _filled(found, owner, kind))
    namespace = _instance_dict(owner, kind)
    if namespace is not None and name in namespace:
        return True
    if found is not _MISSING:
        return _plain_get(found)
    if _inherits(kind, types.ModuleType) and (namespace is None or "__getattr__" in namespace):
        return False  # a module's own `__getattr__`
    return not hook


def _filled(slot: Any, owner: Any, kind: type) -> bool:
    """Whether the interpreter's own descriptor `slot` finds a value (else `__getattr__` would be called)."""
    try:
        slot.__get__(owner, kind)
    except AttributeError:
        return False
    return True


def _class_attribute(owner: type, meta: type, name: str) -> bool:
    """`Class.name` read: its metaclass's and its own descriptors, as `type.__getattribute__` finds them."""
    if lookup(meta, "__getattribute__") is not _TYPE_GETATTRIBUTE or lookup(meta, "__getattr__") is not _MISSING:
        return False
    on_meta = lookup(meta, name)
    if on_meta is not _MISSING and _data_descriptor(type(on_meta)):
        return id(type(on_meta)) in _SLOTS
    found = lookup(owner, name)
    if found is not _MISSING:
        return _plain_get(found)
    return on_meta is _MISSING or _plain_get(on_meta)


# -- data ---------------------------------------------------------------------------------------------------


def is_data(value: Any, budget: list[int] | None = None, memo: Memo | None = None) -> bool:
    """Whether `value` is data all the way down, at most MAX_ITEMS items looked at (`budget`); a long
    container's verdict is kept in `memo`, and read from it while it holds the same object at the same length."""
    kind = type(value)
    if id(kind) in _LEAVES:
        return True
    if id(kind) not in _CONTAINERS:
        return False
    size = len(value)
    if memo is not None and size >= _MEMO_MIN:
        known = memo.get(id(value))
        if known is not None and known[0] is value and known[1] == size:
            return known[2]
    budget = [MAX_ITEMS] if budget is None else budget
    budget[0] -= size * (2 if kind is dict else 1)
    if budget[0] < 0:
        return False
    verdict = all(_items_data(part, budget, memo) for part in ((value, value.values()) if kind is dict else (value,)))
    if memo is not None and size >= _MEMO_MIN:
        memo[id(value)] = (value, size, verdict)  # the object is held, so its id is not reused meanwhile
    return verdict


def _items_data(items: Any, budget: list[int], memo: Memo | None) -> bool:
    kinds = set(map(id, map(type, items)))
    if kinds <= _LEAVES:
        return True
    if not kinds <= _DATA_TYPES:
        return False
    return all(is_data(item, budget, memo) for item in items if id(type(item)) in _CONTAINERS)


def is_safe(value: Any, budget: list[int] | None = None, memo: Memo | None = None) -> bool:
    """Whether a builtin given `value` runs no user code: data, or a safe callable."""
    return is_data(value, budget, memo) or safe_callable(value)


def safe_callable(value: Any) -> bool:
    if id(type(value)) in _BUILTIN_CALLABLES:
        return True
    if type(value) is types.FunctionType:
        closure = value.__closure__ or ()
        try:
            return _reads_only(value.__code__) and all(is_data(cell.cell_contents) for cell in closure)
        except ValueError:  # an empty cell: the call raises NameError, where plain Python raises it
            return False
    return False


_LAMBDA_OPS = frozenset({
    "RESUME", "NOP", "CACHE", "COPY_FREE_VARS", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_LOAD_FAST", "LOAD_DEREF",
    "LOAD_CONST", "RETURN_VALUE", "RETURN_CONST", "BINARY_SUBSCR", "COMPARE_OP", "IS_OP", "UNARY_NEGATIVE", "UNARY_NOT",
    "TO_BOOL", "BUILD_TUPLE", "COPY", "SWAP", "POP_TOP", "POP_JUMP_IF_TRUE", "POP_JUMP_IF_FALSE", "POP_JUMP_IF_NONE",
    "POP_JUMP_IF_NOT_NONE", "POP_JUMP_FORWARD_IF_TRUE", "POP_JUMP_FORWARD_IF_FALSE", "JUMP_IF_TRUE_OR_POP",
    "JUMP_IF_FALSE_OR_POP", "JUMP_FORWARD",
})
_LAMBDAS: weakref.WeakKeyDictionary[types.CodeType, bool] = weakref.WeakKeyDictionary()


def _reads_only(code: types.CodeType) -> bool:
    """A function whose code reads its arguments and closure, subscripts, compares and negates: on data it
    can have no effect and call nothing (a `key=lambda d: -d[1]`). Read once per code object."""
    known = _LAMBDAS.get(code)
    if known is None:
        known = _LAMBDAS[code] = not code.co_names and all(
            i.opname in _LAMBDA_OPS and not isinstance(i.argval, types.CodeType) for i in dis.get_instructions(code)
        )
    return known


# -- the checks, by the kind of instruction they stand before (`overlap.py` picks one) ---------------------


def _shallow(memo: Memo, *values: Any) -> bool:
    """A truth test, an unpacking, a negation, `+` or `*`: the builtin types' own code, items untouched."""
    for v in values:  # a loop, not all(...): these run once per instruction of a window's local work
        if id(type(v)) not in _DATA_TYPES:
            return False
    return True


def _deep(memo: Memo, *values: Any) -> bool:
    """A comparison, `in`, a format, a set or dict built: items compared, hashed or formatted too."""
    budget = None
    for v in values:
        kind = id(type(v))
        if kind in _LEAVES:
            continue
        if kind in _CONTAINERS:  # a container known since the last wait: its verdict, without a call
            known = memo.get(id(v))
            if known is not None and known[0] is v and known[1] == len(v):
                if known[2]:
                    continue
                return False
        budget = [MAX_ITEMS] if budget is None else budget
        if not is_data(v, budget, memo):
            return False
    return True


def _inplace(memo: Memo, target: Any, value: Any, op: int) -> bool:
    """`x += y`: an immutable `x` (a new object is made, nothing an open call holds changes)."""
    if id(type(target)) not in _IMMUTABLE:
        return False
    return id(type(value)) in _DATA_TYPES if _PLAIN_OF[op] in SHALLOW_OPS else _deep(memo, target, value)


def _subscript(memo: Memo, container: Any, key: Any) -> bool:
    """`container[key]`: a builtin container's own lookup, with a key whose hash and `==` are the builtins'
    (a class's `__class_getitem__` is the user's)."""
    kind = id(type(container))
    return (kind in _SCALARS or kind in _CONTAINERS) and is_data(key, None, memo)


def _call(memo: Memo, fn: Any, *arguments: Any) -> bool:
    """A builtin called (`sorted`, `str`, `max`, ...): its arguments data, its key functions safe; `len`,
    `list`, `zip` and the like look at no item, only at the containers' own types."""
    if id(fn) in _SHALLOW_BUILTINS:  # the builtin itself: its id is never another object's
        return all(id(type(v)) in _SCALARS or id(type(v)) in _CONTAINERS for v in arguments)
    budget = [MAX_ITEMS]
    return all(is_safe(v, budget, memo) for v in arguments)


CHECKS: dict[str, Callable[..., bool]] = {"shallow": _shallow, "deep": _deep, "inplace": _inplace,
                                          "subscript": _subscript, "call": _call, "attribute": _attribute}


allow_descriptor(MakeMethod)  # reading `component.method` makes a BoundMake: patchkit's code, not the user's
