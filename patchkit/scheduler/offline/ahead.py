"""A profile's next worker, started on another core while the profile before it is measured.

Starting a worker (importing its component's libraries, loading its model) takes seconds that
measure nothing. On a machine of two cores or more the profiler pins two consecutive one-core jobs
to different cores and starts the second's worker while the first is measured: the start runs on a
core no measurement uses, so it shortens the plan without touching a measured time; nothing starts
beside an engine profiled through its cost model, which is fitted on a few runs. One worker at
most is started ahead; the profiler takes it when the job it was started for begins, and drops it
(stopped once started) when profiling ends early.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

from patchkit.orchestrator.backend import Replica
from patchkit.orchestrator.local import LocalBackend

__all__ = ["Ahead"]

logger = logging.getLogger(__name__)


class Ahead:
    """The one worker started ahead, and the job it was started for. Used by the profiler alone."""

    def __init__(self) -> None:
        self._job: Any = None
        self._task: asyncio.Task[Replica] | None = None

    def begin(self, job: Any, start: Coroutine[Any, Any, Replica]) -> None:
        """Start `job`'s worker now (`start`), in the background."""
        if self._task is not None:
            start.close()
            raise RuntimeError("a worker is already being started ahead")
        self._job, self._task = job, asyncio.create_task(start)

    async def take(self, job: Any) -> Replica | None:
        """The worker started ahead for `job` (waiting for its start to end), or None when none was."""
        if self._task is None or self._job is not job:
            return None
        task, self._job, self._task = self._task, None, None
        return await task

    async def drop(self, backend: LocalBackend) -> None:
        """Stop the worker started ahead, if one was and nobody took it (its start is awaited: a process
        being spawned cannot be interrupted)."""
        task, self._job, self._task = self._task, None, None
        if task is None:
            return
        try:
            replica = await task
        except Exception as exc:  # it was not needed: its failure is nobody's
            logger.debug("a worker started ahead failed to start: %s", exc)
            return
        await backend.stop(replica)
