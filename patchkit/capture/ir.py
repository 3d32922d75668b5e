"""The intermediate form of a captured `with` block: its body as abstract bytecode plus where it ends.

`extract.extract_block` produces a `CapturedBlock` from a code object; the passes in `analysis`,
`assemble` and `dataflow` read it and never change it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Scope = Literal["function", "module"]


@dataclass(frozen=True)
class BlockExit:
    """Where the body leaves the block without `return`: the pipeline returns its output variable.

    It stands in the instruction list like a pseudo-instruction; `lineno` is the `with` line and
    `left_at` the line of the last statement run before control leaves the block.
    """

    lineno: int
    left_at: int | None = None


@dataclass(frozen=True)
class CapturedBlock:
    """One `with patchkit.capture():` body, cut out of the code object that holds it.

    `body` holds abstract instructions of the `bytecode` library (Instr, Label, TryBegin, TryEnd,
    SetLineno) and `BlockExit` markers. Every `return` inside the block is already a RETURN_VALUE of
    the body; the with-statement's own exception handling is gone.
    """

    scope: Scope
    filename: str
    code_name: str
    with_lineno: int
    first_lineno: int
    body: tuple[Any, ...]
    has_return: bool
    body_offset: int  # byte offset of the first body instruction in the original code
    code_flags: int
    nested_codes: tuple[Any, ...] = field(default=())
