"""Component-level batching: one queue per (component, method), feeding that component's replicas.

A batch leaves a queue when it holds `batch_size` calls, or when its oldest call has waited
`batch_wait_s`, and only when a replica has a free slot (`max_inflight` batches each): while
every replica is busy, calls accumulate, so batches grow with load. It goes to the least-loaded
replica. A replica already running a batch gets another only when the queue fills a whole one:
a batch sent early waits out the running one at the worker, and the calls that arrive meanwhile
wait for both, where they would otherwise have joined it. Below saturation a replica thus runs one
batch at a time; at saturation the extra slots hide the hop between batches.
Calls of requests at risk of missing their SLO (those given a `slack`) leave first, least slack
first; the others keep their arrival order. Calls whose replica died are re-queued at the front,
up to `max_retries` times.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from patchkit.errors import WorkerDiedError
from patchkit.orchestrator.backend import Replica
from patchkit.orchestrator.execute import Failure, Outcome

__all__ = ["BatchQueue", "PendingCall", "QueueStats", "ReplicaSet"]

THROUGHPUT_WINDOW_S = 10.0


@dataclass(eq=False)
class PendingCall:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    future: asyncio.Future[Outcome]
    enqueued: float
    attempts: int = 0
    slack: float | None = None  # seconds to spare when its request is at risk; None when it is not
    dispatched: float | None = None  # when it last left the queue in a batch

    @property
    def waited(self) -> float:
        """Seconds it spent queued before it left in a batch (0 until then)."""
        return self.dispatched - self.enqueued if self.dispatched is not None else 0.0


@dataclass
class QueueStats:
    calls: int = 0
    batches: int = 0
    failures: int = 0
    retries: int = 0
    queue_wait_s: float = 0.0  # summed over calls: enqueue to dispatch
    service_s: float = 0.0  # summed over batches: dispatch to outcomes
    completions: deque[tuple[float, int]] = field(default_factory=deque)
    last_done: float | None = None  # when a batch last came back answered; None: none has yet

    def completed(self, now: float, calls: int) -> None:
        self.last_done = now
        self.completions.append((now, calls))
        while self.completions and self.completions[0][0] < now - THROUGHPUT_WINDOW_S:
            self.completions.popleft()

    def throughput(self, now: float) -> float:
        """Calls per second completed over the last window."""
        recent = sum(n for t, n in self.completions if t >= now - THROUGHPUT_WINDOW_S)
        return recent / THROUGHPUT_WINDOW_S


class ReplicaSet:
    """The live replicas of one component, shared by its methods' queues."""

    def __init__(self, component: str, max_inflight: int) -> None:
        self.component = component
        self.max_inflight = max_inflight
        self.replicas: list[Replica] = []
        self.queues: list[BatchQueue] = []

    def add(self, replica: Replica) -> None:
        """Called by the supervisor's on_up: the replica takes calls from now on."""
        self.replicas.append(replica)
        self.kick()

    def remove(self, replica: Replica) -> None:
        if replica in self.replicas:
            self.replicas.remove(replica)

    def least_loaded(self, *, full: bool = True) -> Replica | None:
        """The alive replica with the fewest batches in flight, if one has a free slot; unless the
        batch is `full`, only an idle replica will do."""
        most = self.max_inflight if full else 1
        best = None
        for replica in self.replicas:
            if replica.alive and replica.inflight < most and (best is None or replica.inflight < best.inflight):
                best = replica
        return best

    def kick(self) -> None:
        """A slot opened or a replica joined: let the queue with the oldest call go first."""
        for queue in sorted(self.queues, key=BatchQueue.oldest):
            queue.dispatch()


class BatchQueue:
    def __init__(
        self,
        replicas: ReplicaSet,
        method: str,
        *,
        batch_size: int,
        batch_wait_s: float,
        max_retries: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replicas = replicas
        self.method = method
        self.batch_size = batch_size
        self.batch_wait_s = batch_wait_s
        self.max_retries = max_retries
        self.clock = clock
        self.stats = QueueStats()
        self._pending: deque[PendingCall] = deque()
        self._urgent = 0  # pending calls with a slack
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        replicas.queues.append(self)

    def __len__(self) -> int:
        return len(self._pending)

    def oldest(self) -> float:
        return self._pending[0].enqueued if self._pending else float("inf")

    def submit(self, args: tuple[Any, ...], kwargs: dict[str, Any], slack: float | None = None) -> PendingCall:
        """Queue one call; called from a request's greenlet. Its `future` resolves to its Outcome.

        `slack`: the call's request is at risk with this many seconds to spare (negative: late); it
        jumps the queue ahead of calls with more slack and of every call without one.
        """
        loop = asyncio.get_running_loop()
        call = PendingCall(args, kwargs, loop.create_future(), self.clock(), slack=slack)
        self._pending.append(call)
        self._urgent += slack is not None
        if not self._scheduled:
            # Calls submitted in the same loop turn (a burst of requests) leave in one batch.
            self._scheduled = True
            loop.call_soon(self.dispatch)
        return call

    def dispatch(self) -> None:
        """Send every batch that may leave now; called on submit, on timers and when a slot opens."""
        self._scheduled = False
        while self._pending:
            while self._pending and self._pending[0].future.done():  # its request was cancelled
                self._urgent -= self._pending.popleft().slack is not None
            if not self._pending:
                return
            full = len(self._pending) >= self.batch_size
            if not full and self._wait_more():
                return
            replica = self.replicas.least_loaded(full=full)
            if replica is None:
                return
            batch = self._take()
            if batch:
                replica.inflight += 1
                asyncio.get_running_loop().create_task(self._send(replica, batch))

    def _wait_more(self) -> bool:
        """True when the partial batch should wait for more calls; arms a timer for its deadline."""
        leave_at = self._pending[0].enqueued + self.batch_wait_s
        if self.clock() >= leave_at:
            return False
        if self._timer is None or self._timer.cancelled():
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(leave_at - self.clock(), self._on_timer)
        return True

    def _on_timer(self) -> None:
        self._timer = None
        self.dispatch()

    def _take(self) -> list[PendingCall]:
        batch: list[PendingCall] = []
        now = self.clock()
        if self._urgent:  # at-risk calls first, least slack first; sorted() keeps the rest in order
            self._pending = deque(sorted(self._pending, key=lambda c: (c.slack is None, c.slack or 0.0)))
        while self._pending and len(batch) < self.batch_size:
            call = self._pending.popleft()
            self._urgent -= call.slack is not None
            if not call.future.done():
                call.dispatched = now
                self.stats.queue_wait_s += now - call.enqueued
                batch.append(call)
        return batch

    async def _send(self, replica: Replica, batch: list[PendingCall]) -> None:
        start = self.clock()
        try:
            outcomes = await replica.channel.run_batch(self.method, [(c.args, c.kwargs) for c in batch])
        except WorkerDiedError as exc:
            self._retry(batch, exc)
        except Exception as exc:  # the calls could not be sent at all (an argument does not pickle)
            self._deliver(batch, [(False, Failure.of(exc))] * len(batch))
        else:
            self._deliver(batch, outcomes)
            self.stats.service_s += self.clock() - start
        finally:
            replica.inflight -= 1
            self.replicas.kick()

    def _deliver(self, batch: list[PendingCall], outcomes: list[Outcome]) -> None:
        self.stats.batches += 1
        self.stats.calls += len(batch)
        self.stats.completed(self.clock(), len(batch))
        for call, outcome in zip(batch, outcomes):
            self.stats.failures += not outcome[0]
            if not call.future.done():
                call.future.set_result(outcome)

    def _retry(self, batch: list[PendingCall], error: WorkerDiedError) -> None:
        """Re-queue the calls of a dead replica at the front, in order; fail those out of retries."""
        for call in reversed(batch):
            call.attempts += 1
            if call.future.done():
                continue
            if call.attempts > self.max_retries:
                died = WorkerDiedError(f"{error}; the call was tried {call.attempts} times")
                failure = Failure(died, "WorkerDiedError", str(died), "")
                call.future.set_result((False, failure))
            else:
                self.stats.retries += 1
                self._pending.appendleft(call)
                self._urgent += call.slack is not None
