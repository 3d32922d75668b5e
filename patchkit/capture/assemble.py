"""IR -> code: turn a `CapturedBlock` into a `Program` that runs the body on given variables.

A block from a function becomes a function whose keyword-only parameters are the block's inputs
and bound objects; its cells and free variables become cells of that function. A block from module
level (a script, `exec` code, a notebook cell) keeps its module-level semantics and is evaluated in
a fresh namespace built per run, so comprehensions and lambdas in it see the inputs as globals.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bytecode import Bytecode, CellVar, CompilerFlags, FreeVar, Instr

from patchkit.capture.compat import PY312
from patchkit.capture.ir import BlockExit, CapturedBlock
from patchkit.component.calls import DeferredSites, deferring

__all__ = ["Program", "assemble"]

PIPELINE_CODE_NAME = "<capture>"


@dataclass(frozen=True)
class Program:
    """Runs a captured body: `run(variables)` returns the pipeline's output.

    `variables` maps every parameter (inputs and bound objects) to its value for this run.
    Function-scope programs resolve globals in the module of the captured code, and add nothing to them.
    A program rewritten for parallel calls (`parallel.py`) lists its deferred calls: per code object (the
    path of constants from `code` to it), the indexes of its call instructions; while it runs, calls made
    there have `deferred=True` sites (`component.calls.deferring`), and nowhere else.
    """

    scope: str
    code: types.CodeType
    params: tuple[str, ...]
    module_globals: Mapping[str, Any] | None
    module_name: str
    deferred: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...] = ()

    @functools.cached_property
    def deferred_sites(self) -> DeferredSites | None:
        """The marks of its deferred calls, made once per program (and process)."""
        if not self.deferred:
            return None
        marks = []
        for path, indexes in self.deferred:
            code = self.code
            for k in path:
                code = code.co_consts[k]
            marks.append((code, indexes))
        return DeferredSites(marks)

    def _function(self) -> types.FunctionType:
        assert self.module_globals is not None
        return types.FunctionType(self.code, self.module_globals, PIPELINE_CODE_NAME)  # type: ignore[arg-type]

    def run(self, variables: Mapping[str, Any]) -> Any:
        sites = self.deferred_sites
        with deferring(sites) if sites is not None else contextlib.nullcontext():
            if self.scope == "function":
                return self._function()(**variables)
            namespace = {"__builtins__": builtins, "__name__": self.module_name, **variables}
            return eval(self.code, namespace)  # noqa: S307 - the user's own captured code

    def __reduce__(self) -> tuple[Any, ...]:
        # Function scope pickles as a function, so cloudpickle carries the globals the code reads.
        if self.scope == "function":
            return (_program_from_function, (self._function(), self.params, self.module_name, self.deferred))
        return (Program, (self.scope, self.code, self.params, None, self.module_name, self.deferred))


def _program_from_function(
    fn: types.FunctionType, params: tuple[str, ...], module_name: str, deferred: tuple[Any, ...] = ()
) -> Program:
    return Program("function", fn.__code__, params, fn.__globals__, module_name, deferred)


def assemble(block: CapturedBlock, params: tuple[str, ...], output: str | None, module_globals: Mapping[str, Any]) -> Program:
    """Build the program for `block` taking `params`, returning `output` where the body ends."""
    module_name = str(module_globals.get("__name__", "__main__"))
    if block.scope == "module":
        code = _module_code(block, output)
        return Program("module", code, params, None, module_name)
    return Program("function", _function_code(block, params, output), params, module_globals, module_name)


def _load_output(block: CapturedBlock, output: str | None, cells: set[str], location: Any) -> list[Instr]:
    if output is None:
        return [Instr("LOAD_CONST", None, location=location)]
    if block.scope == "module":
        return [Instr("LOAD_NAME", output, location=location)]
    if output in cells:
        return [Instr("LOAD_DEREF", CellVar(output), location=location)]
    return [Instr("LOAD_FAST_CHECK" if PY312 else "LOAD_FAST", output, location=location)]


def _finish(block: CapturedBlock, output: str | None, cells: set[str]) -> list[Any]:
    out: list[Any] = []
    for e in block.body:
        if isinstance(e, BlockExit):
            out += _load_output(block, output, cells, None)
            out.append(Instr("RETURN_VALUE"))
        elif block.scope == "function" and isinstance(e, Instr):
            out.append(_localise(e))
        else:
            out.append(e)
    return out


def _localise(e: Instr) -> Instr:
    """Free variables of the original function become cells of the pipeline function."""
    if isinstance(e.arg, FreeVar):
        return Instr(e.name, CellVar(e.arg.name), location=e.location)
    if PY312 and e.name == "LOAD_FAST":
        # Bound-ness proven in the original frame may not hold here: keep the unbound check.
        return Instr("LOAD_FAST_CHECK", e.arg, location=e.location)
    return e


def _cell_names(block: CapturedBlock) -> set[str]:
    return {e.arg.name for e in block.body if isinstance(e, Instr) and isinstance(e.arg, (CellVar, FreeVar))}


def _function_code(block: CapturedBlock, params: tuple[str, ...], output: str | None) -> types.CodeType:
    cells = _cell_names(block)
    bc = Bytecode()
    bc.name = PIPELINE_CODE_NAME
    bc.filename = block.filename
    bc.first_lineno = block.with_lineno
    bc.argcount = 0
    bc.kwonlyargcount = len(params)
    bc.argnames = list(params)
    bc.cellvars = sorted(cells)
    bc.flags = CompilerFlags.OPTIMIZED | CompilerFlags.NEWLOCALS
    prologue = [Instr("MAKE_CELL", CellVar(name)) for name in bc.cellvars]
    bc.extend([*prologue, Instr("RESUME", 0), *_finish(block, output, cells)])
    return bc.to_code()


def _module_code(block: CapturedBlock, output: str | None) -> types.CodeType:
    bc = Bytecode()
    bc.name = PIPELINE_CODE_NAME
    bc.filename = block.filename
    bc.first_lineno = block.with_lineno
    bc.flags = CompilerFlags(0)
    bc.extend([Instr("RESUME", 0), *_finish(block, output, set())])
    return bc.to_code()
