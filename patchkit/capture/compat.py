"""Python-version differences in bytecode, gated on named flags (3.11, 3.12 and 3.13 are supported)."""

from __future__ import annotations

import sys

PY312 = sys.version_info >= (3, 12)
PY313 = sys.version_info >= (3, 13)

# Opcodes that end a basic block without falling through.
TERMINATORS = frozenset({"RETURN_VALUE", "RETURN_CONST", "RAISE_VARARGS", "RERAISE"})
# Opcodes that make a code object a generator or coroutine: a pipeline body cannot hold them.
SUSPENDING = frozenset({"YIELD_VALUE", "GET_AWAITABLE", "GET_AITER", "GET_ANEXT", "SEND", "ASYNC_GEN_WRAP"})
# The call of `__exit__(None, None, None)` that closes a `with` block: 3.11 spells it PRECALL 2; CALL 2.
EXIT_CALL = ("LOAD_CONST", "LOAD_CONST", "LOAD_CONST") + (("CALL",) if PY312 else ("PRECALL", "CALL"))
CALL_OPS = frozenset({"CALL", "CALL_KW", "CALL_FUNCTION_EX"})
NAME_LOADS = frozenset({"LOAD_NAME", "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_DEREF", "LOAD_CLOSURE", "LOAD_GLOBAL"})
NAME_STORES = frozenset({"STORE_NAME", "STORE_FAST", "STORE_DEREF", "STORE_GLOBAL"})
NAME_DELETES = frozenset({"DELETE_NAME", "DELETE_FAST", "DELETE_DEREF", "DELETE_GLOBAL"})


def name_of(arg: object) -> str:
    """The variable name an instruction argument refers to.

    LOAD_GLOBAL carries `(push_null, name)` and 3.12's LOAD_ATTR `(is_method, name)`; cell and free
    variables are `CellVar`/`FreeVar` objects with a `.name`.
    """
    if isinstance(arg, tuple):
        return str(arg[1])
    return str(getattr(arg, "name", arg))

# `super()` with no arguments: the call that follows LOAD_GLOBAL super (3.11 spells it PRECALL 0; CALL 0).
# 3.12+ compiles `super().name` to LOAD_SUPER_ATTR, whose argument says whether two were given.
ZERO_ARG_CALL = ("CALL",) if PY312 else ("PRECALL", "CALL")
HAS_SUPER_ATTR = PY312
