"""`Pipeline`: a captured `with` block that runs again on new inputs, locally or deployed."""

from __future__ import annotations

import copy
import io
import marshal
import pickle
import sys
import threading
import types
from collections import ChainMap
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import cloudpickle

from patchkit.capture.assemble import Program
from patchkit.capture.graph import Graph
from patchkit.capture.pending import RUNTIME
from patchkit.capture.recorder import CallRecord, Recorder
from patchkit.core import Component, active_call_hook, call_hook
from patchkit.errors import PatchkitError, unknown_input
from patchkit.program.identity import Identity, Memo, PipelineVersion, identity, program_identity, stamp_component

__all__ = ["Pipeline", "last_pipeline", "set_last_pipeline", "stamp"]

MAX_RECORDED_CALLS = 10_000


class Pipeline:
    """What `with patchkit.capture() as pipeline:` gives back.

    `pipeline(**overrides)` runs it again, locally and eagerly, on new inputs; `patchkit.deploy(pipeline)`
    serves it.

    Called inside another pipeline (a capture block, or a deployed front-end running one), a
    Pipeline is bound by identity like a component, its components are the outer pipeline's too,
    and its calls go where the outer pipeline's calls go.

    A Pipeline pickles (with pickle or cloudpickle; components travel as specs) and answers the same
    in the process that loads it, its calls at the same call sites: this is how the front-end
    receives it, and how it knows which calls stream the output.

    Attributes:
        output: the variable the pipeline returns, or "return" when the block's `return` is it.
        graph: the component calls with their data and control dependencies, and visit counts.
        recorded: the calls of its eager runs (the capture's, if it ran, and each `pipeline(...)`), up
            to 10,000, for profiling.
        doc: the docstring of the function whose body holds the capture block, or None (a block at module
            level): what describes the pipeline as an MCP tool.
    """

    def __init__(
        self,
        program: Program,
        inputs: Mapping[str, Any],
        bindings: Mapping[str, Any],
        output: str | None,
        graph: Graph,
        parallel: Program | None = None,
    ) -> None:
        self._program = program
        self._parallel = parallel  # the body rewritten for parallel calls; None: no call could overlap
        self._defaults = dict(inputs)
        self._bindings = dict(bindings)
        self.output = output
        self.graph = graph
        self.recorded: list[CallRecord] = []
        self.doc: str | None = None
        self._lock = threading.Lock()
        self._component_globals: tuple[tuple[str, str, str], ...] = ()  # set when it is pickled: see component_aliases
        self._stamped: PipelineVersion | None = None  # set by stamp(), where the user's code is; travels with it

    @property
    def inputs(self) -> dict[str, Any]:
        """The input names, with their values at capture as defaults."""
        return dict(self._defaults)

    @property
    def components(self) -> dict[str, Component]:
        """The components the pipeline calls, by name."""
        return self.graph.components()

    def component_aliases(self) -> dict[str, Component]:
        """The components a loading process's modules hold in place of this pipeline's, by their uid.

        In a process that loaded this pipeline (a front-end), a helper of the user's module travels by
        reference and reads that module's globals again, where its import made new objects (`llm =
        LlamaCppGenerator()` run twice). The front-end sends their calls to the deployed components.
        """
        deployed = {c._patchkit_spec.uid: c for c in self.components.values()}
        aliases: dict[str, Component] = {}
        for module_name, name, uid in self._component_globals:
            module = sys.modules.get(module_name)
            value = vars(module).get(name) if module is not None else None
            if isinstance(value, Component) and uid in deployed and value._patchkit_spec.uid != uid:
                aliases[value._patchkit_spec.uid] = deployed[uid]
        return aliases

    def fingerprint(self) -> str:
        """A digest of what the pipeline runs, computed now: its `identity()`'s; a version's content hash."""
        return self.identity().digest

    def identity(self) -> Identity:
        """What the pipeline runs, part by part (`patchkit.program.identity.Identity`), computed now.

        Its code, the module globals and helpers that code reads (followed as a component's are), the objects
        it is bound to, its inputs' defaults (by value) and output, and each component's fingerprint
        (`component NAME`).
        """
        return self._versions(Memo()).whole

    def stamp(self, memo: Memo | None = None) -> PipelineVersion:
        """Compute the pipeline's version and its components' here, and keep them to travel with it.

        Called where the user's code is, once per deploy, update, reload and plan (the caller of
        `deploy()`, `Endpoint.update()`, `patchkit serve`, `plan()`): each component's version goes with its
        spec (`ComponentSpec.digest`), the pipeline's with the pipeline (`stamped`), and a process that holds
        none of the user's code (the front-end) compares them without deriving any. Each large value
        (a 100 MB array, a list of texts) is read once, however many components hold it.

        Args:
            memo: the large values read already by the stamps of the other pipelines of one deployment.

        Returns:
            The version: the pipeline's own identity and each component's, by name.
        """
        versions = self._versions(memo or Memo())
        for name, component in self.components.items():
            stamp_component(component, versions.components[name].digest)
        self._stamped = versions
        return versions

    @property
    def stamped(self) -> PipelineVersion | None:
        """The version `stamp()` last computed (it travels with the pipeline); None before the first."""
        return self._stamped

    def _versions(self, memo: Memo) -> PipelineVersion:
        components = {name: identity(c, memo) for name, c in sorted(self.components.items())}
        program = self._program
        bound = {name: value.fingerprint() if isinstance(value, Pipeline) else value
                 for name, value in self._bindings.items() if not isinstance(value, Component)}
        own = program_identity(program.code, program.module_globals, program.module_name, bound, self._defaults, memo)
        parts = {label: part for label, part in own.parts.items() if not label.startswith("component ")}  # by name below
        return PipelineVersion(Identity({**parts, "output": str(self.output)}), components)

    def __patchkit_components__(self) -> dict[str, Component]:
        """What capture registers when another pipeline's block holds this one (capture/holders.py)."""
        return self.components

    def variables(self, overrides: Mapping[str, Any]) -> dict[str, Any]:
        """Every parameter of the program for one run: overrides, fresh copies of defaults, bindings.

        Args:
            overrides: inputs by name; those left out keep (a copy of) their value at capture.

        Returns:
            The program's variables by name.

        Raises:
            InputError: an input the pipeline does not have (with the closest known name).
        """
        for name in overrides:
            if name not in self._defaults:
                raise unknown_input(name, self._defaults)
        values = {name: overrides[name] if name in overrides else copy.deepcopy(v) for name, v in self._defaults.items()}
        return {**self._bindings, **values}

    @property
    def parallel(self) -> bool:
        """Whether a deployment can overlap its calls: some call of the body is deferred (`graph.overlap_groups`)."""
        return self._parallel is not None

    def run(self, variables: Mapping[str, Any], *, parallel: bool = False) -> Any:
        """Run the body once with `variables` from `variables()`; component calls go to the active hook.

        `parallel`: run the body rewritten for parallel calls (capture/parallel.py), whose deferred calls
        the hook may answer with a `Pending`: only a deployment's runner, which waits for them, asks for it.
        """
        if parallel and self._parallel is not None:
            return self._parallel.run(variables)
        return self._program.run(variables)

    def __call__(self, **overrides: Any) -> Any:
        """Run again on new inputs.

        Inside another pipeline's run its calls go to that run's hook (recorded by the outer capture, or sent to workers by the
        front-end); otherwise they run here and are counted in this pipeline's graph.

        Args:
            **overrides: inputs by name; those left out keep their value at capture.

        Returns:
            The pipeline's output.

        Raises:
            InputError: an input the pipeline does not have.
        """
        if active_call_hook() is not None:
            return self.run(self.variables(overrides))
        return self.recorded_run(overrides)[0]

    def recorded_run(self, overrides: Mapping[str, Any]) -> tuple[Any, list[CallRecord]]:
        """Run here, eagerly, on `overrides` of the inputs; counted in the graph and kept for profiling (`absorb`).

        Args:
            overrides: inputs by name.

        Returns:
            The output and the run's calls, all of them (the kept record is bounded).
        """
        recorder = Recorder()
        with call_hook(recorder):
            result = self.run(self.variables(overrides))
        self.absorb(recorder.calls)
        return result, recorder.calls

    def absorb(self, calls: list[CallRecord]) -> None:
        """Count one eager run's calls in the graph and keep them for profiling."""
        with self._lock:
            self.graph.count_run(calls)
            room = MAX_RECORDED_CALLS - len(self.recorded)
            self.recorded.extend(calls[:room])

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle it as `_dumps` bytes, whatever pickles it.

        The code it runs keeps the call sites its graph names; inputs recorded for profiling stay in this process.
        """
        state = self.__dict__.copy()
        del state["_lock"]
        state["recorded"] = []
        state["_component_globals"] = _component_globals(self.components.values())
        return (_load_pipeline, (_dumps(state),))

    def __repr__(self) -> str:
        inputs = ", ".join(self._defaults)
        names = ", ".join(self.components)
        return f"<Pipeline inputs=({inputs}) output={self.output!r} components=({names})>"


def _component_globals(components: Iterable[Component]) -> tuple[tuple[str, str, str], ...]:
    """(module, name, uid) for each global of an imported module that holds one of `components`.

    `__main__` is left out: it travels by value.
    """
    wanted = {id(c): c for c in components}
    found = []
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if module_name == "__main__" or not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            component = wanted.get(id(value))
            if component is not None and component is value:
                found.append((module_name, name, component._patchkit_spec.uid))
    return tuple(found)


def _marshal_code(code: types.CodeType) -> tuple[Any, ...]:
    return (_unmarshal_code, (marshal.dumps(_swap_consts(code, _runtime_mark)),))


def _unmarshal_code(data: bytes) -> types.CodeType:
    return _swap_consts(marshal.loads(data), _runtime_function)  # noqa: S302 - code this interpreter marshalled


# A parallel program holds the functions of its runtime (`capture/pending.py`) as constants, which marshal
# cannot write: they travel as these marks, by name.
_RUNTIME_MARK = "<patchkit runtime>"
_RUNTIME_NAMES = {id(fn): name for name, fn in RUNTIME.items()}


def _runtime_mark(const: Any) -> Any:
    name = _RUNTIME_NAMES.get(id(const))
    return (_RUNTIME_MARK, name) if name is not None and RUNTIME[name] is const else const


def _runtime_function(const: Any) -> Any:
    marked = type(const) is tuple and len(const) == 2 and const[0] == _RUNTIME_MARK
    return RUNTIME[const[1]] if marked else const


def _swap_consts(code: types.CodeType, swap: Callable[[Any], Any]) -> types.CodeType:
    """`code` with each constant (in nested code too) replaced by `swap(constant)`; itself where none changes."""
    consts = tuple(_swap_consts(c, swap) if isinstance(c, types.CodeType) else swap(c) for c in code.co_consts)
    if all(a is b for a, b in zip(consts, code.co_consts)):
        return code
    return code.replace(co_consts=consts)


class _SitePickler(cloudpickle.Pickler):
    """cloudpickle, except that code objects travel whole (marshalled, as a .pyc file holds them).

    A call's site (`CallSite`) is its code's filename and position, and the front-end finds the
    calls that stream the output, or feed a prefetch, by their sites in the graph. cloudpickle
    (3.1) names every code object it pickles by value "<dynamic-code>": the captured body always,
    and the functions and classes of a script's `__main__`; then no call in the front-end is at
    the site its node has. The front-end runs on the interpreter that pickled it, as marshal needs.
    """

    dispatch_table = ChainMap({types.CodeType: _marshal_code}, cloudpickle.Pickler.dispatch_table)


def _dumps(state: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    _SitePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(state)
    return buffer.getvalue()


def _load_pipeline(payload: bytes) -> Pipeline:
    pipeline = Pipeline.__new__(Pipeline)
    pipeline.__dict__.update(pickle.loads(payload))  # noqa: S301 - a pipeline this interpreter pickled
    pipeline._lock = threading.Lock()
    return pipeline


def stamp(pipelines: Pipeline | Mapping[str, Pipeline]) -> None:
    """`Pipeline.stamp` each of `pipelines` (one, or several by name), each large value they share read once."""
    memo = Memo()
    for pipeline in pipelines.values() if isinstance(pipelines, Mapping) else [pipelines]:
        pipeline.stamp(memo)


_last: Pipeline | None = None


def set_last_pipeline(pipeline: Pipeline) -> None:
    """Make `pipeline` the one `last_pipeline()` returns; called by every capture as its block ends."""
    global _last
    _last = pipeline


def last_pipeline() -> Pipeline:
    """The pipeline of the most recent capture in this process: what `deploy()` uses by default.

    Returns:
        That pipeline.

    Raises:
        PatchkitError: no block was captured yet.
    """
    if _last is None:
        raise PatchkitError("no pipeline captured yet: run a `with patchkit.capture():` block first")
    return _last
