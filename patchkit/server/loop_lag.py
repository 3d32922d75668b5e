"""How late the front-end's event loop runs: user pipeline code runs on it, so a call that blocks it
(a slow regular expression, a blocking HTTP client) delays every request. `/metrics` shows the lag.

A task sleeps `interval_s` again and again and records how much later than asked it woke.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib

__all__ = ["LoopLag"]


class LoopLag:
    """The event loop's lag: the last measured and the largest over the last `window_s` seconds.

    Started and stopped with the front-end server (`FrontendServer.start`/`close`), on its loop; read
    by the metrics collector at scrape time.
    """

    def __init__(self, interval_s: float = 0.1, window_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self.window_s = window_s
        self.last_s = 0.0
        self._recent: collections.deque[tuple[float, float]] = collections.deque()  # (when, lag), oldest first
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start measuring on the running loop; called by the front-end server as it starts."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._measure(), name="patchkit-loop-lag")

    async def stop(self) -> None:
        """Stop measuring; called by the front-end server as it closes."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def record(self, now: float, lag_s: float) -> None:
        """One measurement (seconds late at loop time `now`); the task's, and tests' own."""
        self.last_s = lag_s
        self._recent.append((now, lag_s))
        while self._recent and self._recent[0][0] < now - self.window_s:
            self._recent.popleft()

    @property
    def max_s(self) -> float:
        """The largest lag measured within the window (0 before the first measurement)."""
        return max((lag for _, lag in self._recent), default=0.0)

    async def _measure(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            self.record(now, max(0.0, now - asked))
