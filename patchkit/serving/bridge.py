"""Run synchronous pipeline code on the event loop, one greenlet per request.

The captured pipeline is plain blocking Python. Each request runs it in a greenlet; when the code
calls a component, the call hook hands an awaitable to `await_` and the greenlet switches back to
the request's asyncio task, which awaits it and switches in again with the result (SQLAlchemy's
bridge from sync code to asyncio works the same way). Thousands of requests wait on their
components at once with no OS thread each.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import greenlet

__all__ = ["await_", "run_sync"]

T = TypeVar("T")


class _RequestGreenlet(greenlet.greenlet):
    def __init__(self, fn: Callable[..., Any], driver: greenlet.greenlet) -> None:
        super().__init__(fn, driver)
        self.driver = driver


async def run_sync(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` to completion in a greenlet, awaiting whatever it passes to `await_`.

    Cancelling the awaiting task throws CancelledError into `fn` at its current `await_`. `fn` runs in a
    copy of the awaiting task's context, so what the task had set (the request's id, for its log
    records) holds inside, and what `fn` sets (its call hook) stays its own.
    """
    child = _RequestGreenlet(fn, greenlet.getcurrent())
    child.gr_context = contextvars.copy_context()
    result = child.switch(*args)
    while not child.dead:
        try:
            value = await result
        except BaseException:
            result = child.throw(*sys.exc_info())
        else:
            result = child.switch(value)
    return result


def await_(awaitable: Awaitable[T]) -> T:
    """Wait for `awaitable` from code running under `run_sync`, letting other requests run meanwhile."""
    current = greenlet.getcurrent()
    if not isinstance(current, _RequestGreenlet):
        raise RuntimeError("await_() is only valid inside a request run by patchkit's front-end")
    return current.driver.switch(awaitable)
