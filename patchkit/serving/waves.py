"""Waves: requests admitted in groups, the next group only once the last has finished.

With `deploy(pipelining=False)` the front-end runs requests this way, so requests never sit at
different stages of the pipeline from different groups: calls still batch within a group (every
request of a wave reaches the first component together), but a new request waits for the whole
wave ahead of it. It is the "no pipelining" arm of the ablation in `benchmarks/throughput.py`
(Patchwork's Figure 12(b)), and how a batch-synchronous server runs.
"""

from __future__ import annotations

import asyncio

__all__ = ["Waves"]


class Waves:
    """The gate `RequestRunner.query` passes when pipelining is off; lives on the front-end's event loop."""

    def __init__(self) -> None:
        self.running = 0  # requests of the current wave not yet finished
        self.waiting = 0  # requests waiting for the next wave
        self._next: asyncio.Future[None] | None = None
        self.waves = 0  # waves started, for stats

    async def enter(self) -> None:
        """Called before a request runs: returns at once when no wave is running (this request starts
        one), else when the running wave has finished, together with every request that waited for it."""
        if self.running == 0 and self.waiting == 0:
            self.running = 1
            self.waves += 1
            return
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        self.waiting += 1
        next_wave = self._next
        try:
            await asyncio.shield(next_wave)
        except asyncio.CancelledError:
            if next_wave.done():  # admitted just as it was cancelled: leave the wave it joined
                self.leave()
            else:
                self.waiting -= 1
            raise

    def leave(self) -> None:
        """Called once for each request that `enter` admitted, when it finishes (however it ends)."""
        self.running -= 1
        if self.running > 0:
            return
        if self.waiting > 0 and self._next is not None:
            self.running, self.waiting = self.waiting, 0
            self.waves += 1
            self._next.set_result(None)
            self._next = None
