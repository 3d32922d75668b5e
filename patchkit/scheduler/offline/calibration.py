"""The calibration runs, kept on disk: the calls a pipeline made on each calibration input.

A plan runs the pipeline eagerly on its calibration inputs to record the calls it profiles with and
to count each component's visits. With real models that is most of a warm plan's time: every LLM
call evaluates its prompt again, and a new process loads every model first. The calls of each run
are kept under a key made of the input and the pipeline's version (`Pipeline.stamp`: its code, the
globals and helpers it reads, and each component's version; an edit to any of them runs the calibration
again); a plan with the same calibration reads them back and counts them in the graph as the runs would
have (`Pipeline.absorb`), running nothing.
"""

from __future__ import annotations

import logging
import pickle
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
    """What a calibration run's calls depend on: the input and the pipeline's version (its code, the globals and
    helpers it reads, each component's version: `Pipeline.stamp`), whether or not it has a source file."""
    version = pipeline.stamped if pipeline.stamped is not None else pipeline.stamp()
    return digest((dict(inputs), version.digest))
