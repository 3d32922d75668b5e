"""`patchkit.capture()`: the context manager that turns its `with` body into a `Pipeline`.

On entry it reads the calling frame: the body is cut out of the frame's code object (cached per
code object and offset, so a `with` inside a loop is extracted once), inputs and bound objects
come from the frame's variables (a method's `self` and objects holding components are bound by
identity), helpers that would read stale variables are refused, and the pipeline's graph comes
from a data-flow pass over the body.
With `run=True` the body then runs as ordinary Python while every component call is recorded;
with `run=False` the body is skipped and nothing runs or loads.
"""

from __future__ import annotations

import inspect
import sys
import threading
import types
import warnings
import weakref
from typing import Any

from patchkit.capture.assemble import Program, assemble
from patchkit.capture.dataflow import build_graph
from patchkit.capture.extract import extract_block
from patchkit.capture.frame import frame_namespace, method_receiver, refuse_stale_helpers, resolve_output, split_variables
from patchkit.capture.graph import Graph
from patchkit.capture.ir import CapturedBlock
from patchkit.capture.parallel import parallel_program
from patchkit.capture.recorder import Recorder
from patchkit.capture.skip import BodySkipped, Skipper
from patchkit.core import call_hook
from patchkit.errors import CaptureError
from patchkit.program.pipeline import Pipeline, set_last_pipeline

__all__ = ["Capture", "capture"]

_BLOCKS: weakref.WeakKeyDictionary[types.CodeType, dict[tuple[int, str], CapturedBlock]] = weakref.WeakKeyDictionary()
_PROGRAMS: weakref.WeakKeyDictionary[types.CodeType, dict[tuple[Any, ...], Program]] = weakref.WeakKeyDictionary()
_PARALLEL: weakref.WeakKeyDictionary[
    types.CodeType, dict[tuple[Any, ...], tuple[Program | None, list[tuple[str, ...]]]]
] = weakref.WeakKeyDictionary()
_active = threading.local()


def _block(code: types.CodeType, offset: int) -> CapturedBlock:
    # Code objects compare equal across files when their bytecode is equal: key by file too.
    per_code = _BLOCKS.setdefault(code, {})
    key = (offset, code.co_filename)
    if key not in per_code:
        per_code[key] = extract_block(code, offset)
    return per_code[key]


def _program(
    code: types.CodeType,
    offset: int,
    block: CapturedBlock,
    params: tuple[str, ...],
    output: str | None,
    module_globals: dict[str, Any],
) -> Program:
    per_code = _PROGRAMS.setdefault(code, {})
    key = (offset, code.co_filename, params, output, id(module_globals))
    if key not in per_code:
        per_code[key] = assemble(block, params, output, module_globals)
    return per_code[key]


def _parallel(
    code: types.CodeType,
    offset: int,
    block: CapturedBlock,
    graph: Graph,
    params: tuple[str, ...],
    output: str | None,
    module_globals: dict[str, Any],
) -> Program | None:
    """The block rewritten for parallel calls (`graph.overlap_groups` filled), made once per block and calls found.

    None, with a warning, should the rewrite fail: the pipeline then runs one call at a time.
    """
    per_code = _PARALLEL.setdefault(code, {})
    classes = {name: type(component) for name, component in graph.components().items()}
    calls = tuple((n.site, n.id, n.method, classes.get(n.component)) for n in graph.nodes.values())
    key = (offset, code.co_filename, params, output, id(module_globals), calls)
    if key not in per_code:
        try:
            program = parallel_program(block, graph, params, output, module_globals)
        except Exception as exc:  # a construct the rewrite does not know: calls stay sequential, answers the same
            warnings.warn(f"{block.filename}:{block.with_lineno}: parallel calls are off for this pipeline: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)
            program = None
        per_code[key] = (program, graph.overlap_groups)
    program, groups = per_code[key]
    graph.overlap_groups = list(groups)
    return program


class Capture:
    """The context manager `capture()` returns; `__enter__` gives the Pipeline."""

    def __init__(self, output: str | None, run: bool) -> None:
        self._output = output
        self._run = run
        self._pipeline: Pipeline | None = None
        self._recorder: Recorder | None = None
        self._hook: Any = None
        self._skipper: Skipper | None = None

    def __enter__(self) -> Pipeline:
        frame = sys._getframe(1)
        code = frame.f_code
        if getattr(_active, "depth", 0):
            raise CaptureError(
                "a capture block inside another capture block",
                filename=code.co_filename,
                lineno=frame.f_lineno,
                hint="Capture the outer block only; call the inner code from it.",
            )
        block = _block(code, frame.f_lasti)
        namespace = frame_namespace(frame, block.scope)
        output_name, output_label = resolve_output(block, self._output, namespace)
        receiver = method_receiver(code, namespace) if block.scope == "function" else None
        variables = split_variables(block, namespace, output_name, receiver)
        refuse_stale_helpers(block, variables, frame.f_globals, code)
        params = tuple(sorted({**variables.inputs, **variables.bindings}))
        program = _program(code, frame.f_lasti, block, params, output_name, frame.f_globals)
        graph = build_graph(block, variables.inputs, variables.bindings, frame.f_globals, output_name)
        parallel = _parallel(code, frame.f_lasti, block, graph, params, output_name, frame.f_globals)
        self._pipeline = Pipeline(program, variables.inputs, variables.bindings, output_label, graph, parallel)
        self._pipeline.doc = _docstring(code, frame.f_globals)
        _active.depth = 1
        if self._run:
            self._recorder = Recorder()
            self._hook = call_hook(self._recorder)
            self._hook.__enter__()
        else:
            self._skipper = Skipper(frame, block.body_offset)
            self._skipper.start()
        return self._pipeline

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        _active.depth = 0
        if self._hook is not None:
            self._hook.__exit__(exc_type, exc, tb)
            self._hook = None
        if self._skipper is not None:
            self._skipper.stop()
            self._skipper = None
        assert self._pipeline is not None
        if exc_type is None or exc_type is BodySkipped:
            if self._recorder is not None:
                self._pipeline.absorb(self._recorder.calls)
            set_last_pipeline(self._pipeline)
        self._recorder = None
        return exc_type is BodySkipped


def capture(*, output: str | None = None, run: bool = True) -> Capture:
    """Capture the body of `with patchkit.capture() as pipeline:` as a Pipeline.

        with patchkit.capture() as pipeline:
            docs = retriever.retrieve(query)
            answer = generator.generate(query, docs)

        pipeline(query="What is a generator?")

    Every name the block reads before writing it, bound to a plain value when the block starts (`query`),
    is an input, its value at capture the input's default; components, modules, functions and classes are
    bound by identity instead.

    Args:
        output: the variable the pipeline returns. Left out, a block that contains `return` returns
            what it returns, and any other block returns the variable it assigns last.
        run: run the body once now, recording every component call (True, the default), or skip it
            so that nothing runs or loads here (False).

    Returns:
        The context manager; entering it gives the `Pipeline`.

    Raises:
        CaptureError: on entry, for code the block holds that patchkit cannot turn into a pipeline
            (naming the file, line and construct, with what to write instead).
    """
    return Capture(output, run)


def _docstring(code: types.CodeType, module_globals: dict[str, Any]) -> str | None:
    """The docstring of the function whose code `code` is, found by its qualified name in its module.

    None for code at module level (a module's docstring tells of the script, not of its pipeline), and where
    the function has none or cannot be found (a nested function).
    """
    found: object = module_globals if code.co_name != "<module>" else None
    for part in code.co_qualname.split("."):
        found = found.get(part) if isinstance(found, dict) else getattr(found, part, None)
    function = getattr(found, "__func__", found)
    if getattr(function, "__code__", None) is not code:
        return None
    return inspect.getdoc(function)
