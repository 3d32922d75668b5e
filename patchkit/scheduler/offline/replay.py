"""Answering a profiled holder's calls of the components it holds with what they answered in calibration.

A component given another (a Grader given the pipeline's `llm`) calls it, deployed, on that one's own
replicas: its own replicas only wait for those calls. Its profile must therefore measure its own work,
not the held component's, which is profiled on its own. The profiler serves the held calls the way a
deployment's front-end does (a `CallService` the holder's worker reaches through its `Handles`), but
answers each one with the output the same call had in the calibration runs, at once. A call the
calibration did not make (a holder that is not deterministic) runs on the held component in this
process, as the eager run did.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from patchkit.capture.recorder import CallRecord
from patchkit.core import Component
from patchkit.orchestrator.execute import Failure, Outcome, run_batch
from patchkit.orchestrator.handles import CallService, Handles
from patchkit.scheduler.offline.cache import digest

__all__ = ["Replay"]

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 600.0  # a held call run here (not recorded) may take as long as the component needs


class Replay:
    """The recorded outputs of the held components' calls, served to profiled holders' workers."""

    def __init__(self, records: Iterable[CallRecord], held: dict[str, Component], secret: str) -> None:
        """`held`: the components holders may call, by uid; `records`: the calibration's calls; `secret`:
        the one the workers were started with."""
        self.held, self.secret = held, secret
        self.outputs = {
            digest((r.component, r.method, r.args, r.kwargs)): r.output
            for r in records if r.component._patchkit_spec.uid in held
        }
        self.replayed = self.ran = 0
        self._service: CallService | None = None
        self._handles: Handles | None = None

    async def handles(self) -> Handles:
        """Where a holder's worker sends its held calls: the service, started on first use on 127.0.0.1."""
        if self._handles is None:
            self._service = CallService(self._answer, self.secret)
            address = await self._service.start()
            self._handles = Handles(address, frozenset(self.held), CALL_TIMEOUT_S)
        return self._handles

    async def _answer(self, uid: str, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
        component = self.held.get(uid)
        if component is None:
            return False, Failure(None, "LookupError", f"no component with uid {uid} is held by the profiled pipeline", "")
        key = digest((component, method, args, kwargs))
        if key in self.outputs:
            self.replayed += 1
            return True, self.outputs[key]
        self.ran += 1
        if self.ran == 1:
            logger.info("%s.%s: a held call the calibration did not make runs in this process", type(component).__name__, method)
        outcomes = await asyncio.to_thread(run_batch, component, method, [(args, kwargs)])
        return outcomes[0]

    async def close(self) -> None:
        if self._service is not None:
            await self._service.close()
