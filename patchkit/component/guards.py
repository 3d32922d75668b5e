"""What may run while a request's calls are open: the checks behind the rewritten code's guards.

Parallel calls keep a window open over code that cannot change what an open call receives, nor see or
cause an effect out of plain Python's order (`capture/overlap.py`). Whether an operator, a truth test, a
format, an attribute read or a builtin's call runs only the interpreter's own code depends on the values
it is given, which only the running request knows: the rewritten code asks these checks first (through
`pending.guard`), and the request's open calls are waited for when the answer is no, so that user code
(a `__lt__`, a property, a key function with an effect, a generator) runs where plain Python runs it.

A value is *data* when it is of a builtin scalar or container type (exactly, not a subclass) whose items
are data too, or a class whose metaclass is `type`. A callable is *safe* when it is a builtin function or
a builtin type's method, `operator.itemgetter`, or a lambda that only reads its arguments and compares.
"""

from __future__ import annotations

import dis
import operator
import types
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["CHECKS", "INPLACE_OPS", "SHALLOW_OPS"]

_SCALARS = frozenset({int, float, complex, bool, str, bytes, type(None), range, slice, type(Ellipsis)})
_CONTAINERS = frozenset({list, tuple, set, frozenset, dict})
_IMMUTABLE = frozenset({int, float, complex, bool, str, bytes, tuple, frozenset, type(None)})
_BUILTIN_CALLABLES = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                      types.ClassMethodDescriptorType, operator.itemgetter)
MAX_ITEMS = 10_000  # past this many items a value counts as not data: the check stays cheap beside the work
# BINARY_OP's operators that touch no item of a builtin container (concatenation, repetition, arithmetic);
# the others (`%` formats items, `|`, `&`, `^`, `-` hash them) look at the items too.
SHALLOW_OPS = frozenset({0, 2, 3, 4, 5, 8, 9, 11})  # + // << @ * ** >> /, by BINARY_OP's argument
INPLACE_OPS = frozenset(range(13, 26))  # +=, &=, ... : their argument minus 13 is the operator's


def _builtin(value: Any) -> bool:
    kind = type(value)
    return kind in _SCALARS or kind in _CONTAINERS or kind is type


def is_data(value: Any, budget: list[int] | None = None) -> bool:
    """Whether `value` is data all the way down (at most MAX_ITEMS items looked at)."""
    budget = [MAX_ITEMS] if budget is None else budget
    kind = type(value)
    if kind in _SCALARS or kind is type:
        return True
    if kind not in _CONTAINERS:
        return False
    budget[0] -= len(value)
    if budget[0] < 0:
        return False
    items = value.items() if kind is dict else value
    if kind is dict:
        return all(is_data(k, budget) and is_data(v, budget) for k, v in items)
    return all(is_data(item, budget) for item in items)


def is_safe(value: Any, budget: list[int] | None = None) -> bool:
    """Whether a builtin given `value` runs no user code: data, or a safe callable."""
    return is_data(value, budget) or safe_callable(value)


def safe_callable(value: Any) -> bool:
    if isinstance(value, _BUILTIN_CALLABLES):
        return True
    if type(value) is types.FunctionType:
        closure = value.__closure__ or ()
        return _reads_only(value.__code__) and all(is_data(cell.cell_contents) for cell in closure)
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


def _shallow(*values: Any) -> bool:
    """A truth test, an unpacking, a negation, `+` or `*`: the builtin types' own code, items untouched."""
    return all(_builtin(v) for v in values)


def _deep(*values: Any) -> bool:
    """A comparison, `in`, a format, a set or dict built: items compared, hashed or formatted too."""
    budget = [MAX_ITEMS]
    return all(is_data(v, budget) for v in values)


def _inplace(target: Any, value: Any, op: int) -> bool:
    """`x += y`: an immutable `x` (a new object is made, nothing an open call holds changes)."""
    if type(target) not in _IMMUTABLE:
        return False
    return _shallow(target, value) if op - 13 in SHALLOW_OPS else _deep(target, value)


def _subscript(container: Any, key: Any) -> bool:
    return _builtin(container) and is_data(key)


def _call(fn: Any, *arguments: Any) -> bool:
    """A builtin called (`sorted`, `str`, `max`, ...): its arguments data, its key functions safe."""
    budget = [MAX_ITEMS]
    return all(is_safe(v, budget) for v in arguments)


def _attribute(owner: Any, name: str) -> bool:
    """`owner.name` read: no property, `__getattr__` or `__getattribute__` of the user's runs."""
    kind = type(owner)
    if _builtin(owner) or kind is types.ModuleType:
        return True
    if kind.__getattribute__ is not object.__getattribute__:
        return False
    found = next((vars(k)[name] for k in kind.__mro__ if name in vars(k)), _MISSING)
    if found is _MISSING:
        return name in getattr(owner, "__dict__", {}) or not hasattr(kind, "__getattr__")
    getter = type(found)
    if hasattr(getter, "__set__") or hasattr(getter, "__delete__"):  # a data descriptor: the type's wins
        return getter in (types.MemberDescriptorType, types.GetSetDescriptorType)
    return name in getattr(owner, "__dict__", {}) or not hasattr(getter, "__get__") or getter in _PLAIN_GETTERS


_MISSING = object()
_PLAIN_GETTERS: set[type] = {types.FunctionType, staticmethod, classmethod, types.BuiltinFunctionType,
                             types.MethodDescriptorType, types.WrapperDescriptorType}


def allow_descriptor(kind: type) -> None:
    """Count reading attributes that are `kind` descriptors as running no user code (`@make` methods: the
    bound call they make is patchkit's)."""
    _PLAIN_GETTERS.add(kind)


CHECKS: dict[str, Callable[..., bool]] = {"shallow": _shallow, "deep": _deep, "inplace": _inplace,
                                          "subscript": _subscript, "call": _call, "attribute": _attribute}
