"""Timing calls on a replica being profiled, as the front-end would send them, and reading what failed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from patchkit.core import Call
from patchkit.errors import ComponentError
from patchkit.orchestrator.backend import Replica
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.execute import Failure, Outcome

__all__ = ["check_outcomes", "out_of_memory", "stats", "timed"]


async def timed(replica: Replica, method: str, calls: list[Call], size: int, *, concurrent: bool) -> tuple[float, list[Outcome]]:
    """ms until every call of `calls` is answered, and their outcomes in order: sent as batches of `size`,
    one after another, or, `concurrent`, as one-call batches `size` at a time in flight (how the
    front-end sends a `max_concurrency` method: the next leaves as one is answered)."""
    started = time.perf_counter()
    if concurrent:
        slots = asyncio.Semaphore(size)

        async def one(call: Call) -> list[Outcome]:
            async with slots:
                return await replica.channel.run_batch(method, [CallEnvelope(*call)])

        replies = await asyncio.gather(*(one(call) for call in calls))
    else:
        envelopes = [CallEnvelope(*call) for call in calls]
        replies = [await replica.channel.run_batch(method, envelopes[i : i + size]) for i in range(0, len(calls), size)]
    return (time.perf_counter() - started) * 1000, [outcome for reply in replies for outcome in reply]


def check_outcomes(name: str, method: str, outcomes: list[Outcome], what: str) -> Failure | None:
    """The out-of-memory failure among `outcomes`, if one ran out of memory; raises a ComponentError for
    any other failure, saying it happened `what` ("at batch 8")."""
    failed = next((value for ok, value in outcomes if not ok), None)
    if not isinstance(failed, Failure):
        return None
    if out_of_memory(failed):
        return failed
    message = f"failed while being profiled {what}: {failed.type_name}: {failed.message}"
    raise ComponentError(name, method, message, failed.traceback)


def out_of_memory(failure: Failure) -> bool:
    return failure.type_name in ("MemoryError", "OutOfMemoryError") or "out of memory" in failure.message.lower()


async def stats(replica: Replica) -> dict[str, Any]:
    """The replica's component's own `stats()`."""
    found: dict[str, Any] = (await replica.channel.stats()).get("component_stats", {})
    return found
