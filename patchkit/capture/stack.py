"""How many stack items each instruction pops and pushes, for the data-flow pass (3.11-3.13).

The `bytecode` library's own stack effects are net counts on 3.11, which a taint analysis cannot
use: merging the inputs of a POP_TOP into the value below it would invent dependencies.
"""

from __future__ import annotations

import dis

from bytecode import Instr

from patchkit.capture.compat import PY312, PY313

__all__ = ["pops_pushes"]

_FIXED: dict[str, tuple[int, int]] = {
    "POP_TOP": (1, 0),
    "PRECALL": (0, 0),
    "KW_NAMES": (0, 0),
    "NOP": (0, 0),
    "RESUME": (0, 0),
    "PUSH_NULL": (0, 1),
    "UNARY_NEGATIVE": (1, 1),
    "UNARY_NOT": (1, 1),
    "UNARY_INVERT": (1, 1),
    "GET_ITER": (1, 1),
    "TO_BOOL": (1, 1),
    "FORMAT_SIMPLE": (1, 1),
    "FORMAT_WITH_SPEC": (2, 1),
    "CONVERT_VALUE": (1, 1),
    "CALL_INTRINSIC_1": (1, 1),
    "CALL_INTRINSIC_2": (2, 1),
    "LIST_TO_TUPLE": (1, 1),
    "BINARY_OP": (2, 1),
    "BINARY_SUBSCR": (2, 1),
    "BINARY_SLICE": (3, 1),
    "COMPARE_OP": (2, 1),
    "IS_OP": (2, 1),
    "CONTAINS_OP": (2, 1),
    "STORE_SUBSCR": (3, 0),
    "STORE_SLICE": (4, 0),
    "STORE_ATTR": (2, 0),
    "DELETE_SUBSCR": (2, 0),
    "DELETE_ATTR": (1, 0),
    "RETURN_VALUE": (1, 0),
    "RETURN_CONST": (0, 0),
    "LOAD_CONST": (0, 1),
    "LOAD_SMALL_INT": (0, 1),
    "LOAD_ASSERTION_ERROR": (0, 1),
    "LOAD_BUILD_CLASS": (0, 1),
    "LOAD_LOCALS": (0, 1),
    "IMPORT_NAME": (2, 1),
    "IMPORT_FROM": (0, 1),
    "PUSH_EXC_INFO": (1, 2),
    "POP_EXCEPT": (1, 0),
    "CHECK_EXC_MATCH": (2, 2),
    "CHECK_EG_MATCH": (2, 2),
    "BEFORE_WITH": (1, 2),
    "WITH_EXCEPT_START": (0, 1),
    "GET_LEN": (0, 1),
    "MATCH_MAPPING": (0, 1),
    "MATCH_SEQUENCE": (0, 1),
    "MATCH_KEYS": (0, 1),
    "MATCH_CLASS": (3, 1),
    "SET_FUNCTION_ATTRIBUTE": (2, 1),
    "LOAD_METHOD": (1, 2),
    "COPY": (0, 1),
    "SWAP": (0, 0),
    "END_FOR": (2, 0) if PY312 and not PY313 else (1, 0),
    "POP_ITER": (1, 0),
}
_BUILD = {"BUILD_LIST", "BUILD_TUPLE", "BUILD_SET", "BUILD_STRING", "BUILD_SLICE"}


def pops_pushes(e: Instr, jump: bool = False) -> tuple[int, int]:
    """(items popped, items pushed) when `e` runs; `jump` picks a branch instruction's jump side."""
    name, arg = e.name, e.arg
    if name in _FIXED:
        return _FIXED[name]
    if name in _BUILD:
        return (int(arg), 1)
    if name == "BUILD_MAP":
        return (2 * int(arg), 1)
    if name == "BUILD_CONST_KEY_MAP":
        return (int(arg) + 1, 1)
    if name in ("LIST_APPEND", "SET_ADD", "LIST_EXTEND", "SET_UPDATE", "DICT_UPDATE", "DICT_MERGE"):
        return (1, 0)
    if name == "MAP_ADD":
        return (2, 0)
    if name == "UNPACK_SEQUENCE":
        return (1, int(arg))
    if name == "UNPACK_EX":
        return (1, (int(arg) & 0xFF) + (int(arg) >> 8) + 1)
    if name == "FORMAT_VALUE":
        return (2 if int(arg) & 0x04 else 1, 1)
    if name == "CALL":
        return (int(arg) + 2, 1)
    if name == "CALL_KW":
        return (int(arg) + 3, 1)
    if name == "CALL_FUNCTION_EX":
        return (3 + (int(arg) & 1), 1)
    if name == "MAKE_FUNCTION":
        return (1 if PY313 else 1 + bin(int(arg) & 0xF).count("1"), 1)
    if name == "LOAD_GLOBAL":
        return (0, 2 if arg[0] else 1)
    if name in ("LOAD_ATTR", "LOAD_SUPER_ATTR"):
        base = 3 if name == "LOAD_SUPER_ATTR" else 1
        return (base, 2 if PY312 and arg[0] else 1)
    if name == "RAISE_VARARGS":
        return (int(arg), 0)
    if name.startswith("POP_JUMP"):
        return (1, 0)
    if name in ("JUMP_IF_TRUE_OR_POP", "JUMP_IF_FALSE_OR_POP"):
        return (0, 0) if jump else (1, 0)
    if name == "FOR_ITER":
        if not jump:
            return (0, 1)
        net = dis.stack_effect(e.opcode, 0, jump=True)
        return (-net, 0) if net < 0 else (0, net)
    try:
        net = dis.stack_effect(e.opcode, arg if isinstance(arg, int) else 0, jump=jump)
    except ValueError:
        net = 0
    return (-net, 0) if net < 0 else (0, net)
