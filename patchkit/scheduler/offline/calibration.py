"""The calibration runs, kept on disk: the calls a pipeline made on each calibration input.

A plan runs the pipeline eagerly on its calibration inputs to record the calls it profiles with and
to count each component's visits. With real models that is most of a warm plan's time: every LLM
call evaluates its prompt again, and a new process loads every model first. The calls of each run
are kept under a key made of the input, the pipeline's code, the text of the files that define it and
its components' classes (an edit to any of them runs the calibration again), and the components'
classes and constructor arguments (`cache.identity`); a plan with the same calibration reads them
back and counts them in the graph as the runs would have (`Pipeline.absorb`), running nothing.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import pickle
import types
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import cloudpickle

from patchkit import envs
from patchkit.capture.recorder import CallRecord
from patchkit.scheduler.offline.cache import digest

if TYPE_CHECKING:
    from patchkit.program.pipeline import Pipeline

__all__ = ["CalibrationCache"]

logger = logging.getLogger(__name__)


class CalibrationCache:
    """Calibration runs under `PATCHKIT_CACHE_DIR/calibration`, one file per (pipeline, input)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else envs.cache_dir() / "calibration"

    def run(self, pipeline: Pipeline, inputs: Mapping[str, Any]) -> None:
        """Count one calibration run of `pipeline` on `inputs` in its graph and records: read back when
        this run was made before, else made now (eagerly, here) and kept."""
        path = self.root / f"{_key(pipeline, inputs)}.pkl"
        calls = self._load(path, pipeline)
        if calls is not None:
            pipeline.absorb(calls)
            return
        _, calls = pipeline.recorded_run(inputs)
        self._store(path, pipeline, calls)

    def _load(self, path: Path, pipeline: Pipeline) -> list[CallRecord] | None:
        try:
            stored = pickle.loads(path.read_bytes())  # noqa: S301 - this user's own cache, written below
            return [CallRecord(pipeline.components[name], method, args, kwargs, output, seconds, site)
                    for name, method, args, kwargs, output, seconds, site in stored]
        except FileNotFoundError:
            return None
        except Exception as exc:  # unreadable, or from another pipeline: run it again
            logger.debug("calibration run %s not read (%s): running it again", path.name, exc)
            return None

    def _store(self, path: Path, pipeline: Pipeline, calls: list[CallRecord]) -> None:
        """Write atomically; a run whose calls do not pickle (or name a component the pipeline does not list) is not kept."""
        names = {component._patchkit_spec.uid: name for name, component in pipeline.components.items()}
        try:
            stored = [(names[c.component._patchkit_spec.uid], c.method, c.args, c.kwargs, c.output, c.seconds, c.site)
                      for c in calls]
            data = cloudpickle.dumps(stored)
        except Exception as exc:
            logger.debug("a calibration run is not kept: %s", exc)
            return
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(path)


def _key(pipeline: Pipeline, inputs: Mapping[str, Any]) -> str:
    """What a calibration run's calls depend on: the input, the code and its files, the components."""
    program = pipeline._program.code
    classes = sorted({type(c) for c in pipeline.components.values()}, key=lambda cls: (cls.__module__, cls.__qualname__))
    files = sorted({program.co_filename, *(_source_file(cls) for cls in classes)})
    components = sorted(pipeline.components.items())
    return digest((dict(inputs), _code_identity(program), [_file_digest(f) for f in files], components))


def _code_identity(code: types.CodeType) -> tuple[Any, ...]:
    """A code object as the key sees it: its instructions, names and constants, nested code included
    (not marshal: its output depends on reference counts)."""
    consts = tuple(_code_identity(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.co_code, code.co_names, code.co_varnames, code.co_freevars, consts


def _source_file(cls: type) -> str:
    try:
        return inspect.getsourcefile(cls) or ""
    except TypeError:  # a builtin, or a class made where no file is
        return ""


def _file_digest(path: str) -> tuple[str, str]:
    """A file's name and a hash of its text; of a file that cannot be read (a notebook cell, `-c` code), its name."""
    try:
        return path, hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return path, ""
