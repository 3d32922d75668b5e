"""Component-level batching: one queue per (component, method), feeding that component's replicas.

A batch leaves a queue when it holds `batch_size` calls, or when its oldest call has waited
`batch_wait_s`, and only when a replica has a free slot (`max_inflight` batches each): while
every replica is busy, calls accumulate, so batches grow with load. Where it goes is the router's
choice (router.py: least loaded, or the holder of the call's prefix). A replica already running a
batch gets another only when the queue fills a whole one: a batch sent early waits out the running
one at the worker, and the calls that arrive meanwhile wait for both, where they would otherwise
have joined it. Below saturation a replica thus runs one batch at a time; at saturation the extra
slots hide the hop between batches.
Calls of a pipeline of higher `priority` leave first; among equals, calls of requests at risk of
missing their SLO (those given a `slack`), least slack first; the others keep their arrival order.
Calls whose replica died or got stuck are re-queued at the front, up to `max_retries` times. A call
whose request ends first (it timed out, its client went away) leaves its queue at once, or is
stopped where it runs.

A method with `max_concurrency` (an engine batching concurrent calls itself) is not batched here:
each call leaves as soon as a replica has fewer than `concurrency` of its calls in flight (its batch
size, at most `max_concurrency`), so a call arriving while others run joins them at the engine's
next step. A call waiting for the full replica that holds its prefix lets later calls go first where
they may: moving it would evaluate its prefix again elsewhere, which costs more than the wait. Calls
at risk never wait so.

Liveness: a batch may run `timeout_s` (the method's `@make(timeout_s=...)`, else the deployment's
`call_timeout_s`), counted from when its replica starts it (replicas.py keeps each replica's line).
Past that the replica is stuck: reported to the supervisor through its ReplicaSet, and the batch's
calls are re-queued like those of a dead replica, or fail with DeadlineExceeded once out of retries.
A batch lined up on a replica replaced before it started it (`Turn.move`) is re-queued at the front,
not counted as a retry: it never ran there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from patchkit.crashes import NATIVE_CRASH_SIGNALS
from patchkit.errors import ComponentFailed, DeadlineExceeded, PatchkitError, WorkerDiedError
from patchkit.orchestrator.backend import Replica, ReplicaState
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.execute import Failure, Outcome, ran
from patchkit.orchestrator.supervisor import DOCTOR_HINT
from patchkit.serving.replicas import ReplicaSet, Turn

__all__ = ["BatchQueue", "PendingCall", "QueueStats"]

logger = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 10.0
DEATH_SEEN_S = 3.0  # how long calls whose replica died wait for the supervisor to say how it died (its exit)


@dataclass(eq=False)
class PendingCall:
    """A call in its queue: its envelope (what travels to the replica) and the queue's own bookkeeping.

    `future` resolves to its Outcome; it is also the envelope's `ended`: cancelled, its request ended."""

    envelope: CallEnvelope
    future: asyncio.Future[Outcome]
    enqueued: float
    attempts: int = 0
    slack: float | None = None  # seconds to spare when its request is at risk; None when it is not
    dispatched: float | None = None  # when it last left the queue in a batch
    prefix: str | None = None  # the component's prefix_key for it: routed to the replica holding that state
    priority: int = 0  # its pipeline's: higher leaves first
    batch: int | None = None  # the size of the batch it last left in
    replica: str | None = None  # the replica that batch went to

    @property
    def ranked(self) -> bool:
        """Whether it may leave before calls queued earlier: it has a slack or a priority."""
        return self.slack is not None or self.priority != 0

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


class BatchQueue:
    def __init__(
        self,
        replicas: ReplicaSet,
        method: str,
        *,
        batch_size: int,
        batch_wait_s: float,
        max_retries: int,
        timeout_s: float | None = None,
        concurrency: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`max_retries`: times a call is re-sent after its replica died or got stuck; `timeout_s`: how
        long one batch may run on a replica (None: no limit); `concurrency`: its calls in flight per
        replica, for a `max_concurrency` method (its batch size, up to that bound; None: it is batched here)."""
        self.replicas = replicas
        self.method = method
        self.concurrency = concurrency
        self.batch_size = 1 if concurrency else batch_size
        self.batch_wait_s = batch_wait_s
        self.max_retries = max_retries
        self.timeout_s = timeout_s
        self.clock = clock
        self.stats = QueueStats()
        self._pending: deque[PendingCall] = deque()
        self._ranked = 0  # pending calls with a slack or a priority
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        replicas.queues.append(self)

    def __len__(self) -> int:
        return len(self._pending)

    def oldest(self) -> float:
        """When its oldest pending call was queued; infinity when none is."""
        return self._pending[0].enqueued if self._pending else float("inf")

    def submit(
        self, envelope: CallEnvelope, *, slack: float | None = None, prefix: str | None = None, priority: int = 0
    ) -> PendingCall:
        """Queue one call; called from a request's greenlet. The PendingCall's `future` resolves to its
        Outcome; it becomes the envelope's `ended`: cancelling it (its request ended) takes the call out
        of the queue at once, or stops it where it runs.

        `slack`: the call's request is at risk with this many seconds to spare (negative: late); it
        jumps the queue ahead of calls with more slack and of every call without one, of its `priority` or
        lower (its pipeline's; calls of a higher one leave before those of a lower one). `prefix`: its
        component's `prefix_key`, which routing reads. The envelope's `expires` is when its request
        times out: a worker does not start it later than that.
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Outcome] = loop.create_future()
        envelope.ended = future
        call = PendingCall(envelope, future, self.clock(), slack=slack, prefix=prefix, priority=priority)
        if self.replicas.failed is not None:  # its replicas crash at every start: answered now, not queued
            future.set_result((False, Failure.verdict(self.replicas.failed)))
            return call
        call.future.add_done_callback(lambda _: self._withdraw(call))
        self._pending.append(call)
        self._ranked += call.ranked
        if not self._scheduled:
            # Calls submitted in the same loop turn (a burst of requests) leave in one batch.
            self._scheduled = True
            loop.call_soon(self.dispatch)
        return call

    def fail_waiting(self, error: PatchkitError) -> None:
        """Fail every call waiting here with `error`; called when its component will serve none of them."""
        waiting, self._pending, self._ranked = self._pending, deque(), 0
        for call in waiting:
            if not call.future.done():
                call.future.set_result((False, Failure.verdict(error)))

    def _withdraw(self, call: PendingCall) -> None:
        """Its future is done: if it was cancelled while queued, it leaves the queue now."""
        if call.future.cancelled() and call.dispatched is None:
            try:
                self._pending.remove(call)
            except ValueError:
                return  # taken in a batch in the meantime (the batch skips it), or re-queued and taken
            self._ranked -= call.ranked

    def dispatch(self) -> None:
        """Send every batch that may leave now; called on submit, on timers and when a slot opens."""
        self._scheduled = False
        while self._pending:
            while self._pending and self._pending[0].future.done():  # its request was cancelled
                self._ranked -= self._pending.popleft().ranked
            if not self._pending:
                return
            full = self.concurrency is not None or len(self._pending) >= self.batch_size
            if not full and self._wait_more():
                return
            self._order()
            first = self._first_ready()
            if first is None:
                return
            replica = self.replicas.pick(self._pending[first].prefix, full=full, most=self.concurrency)
            if replica is None:
                return
            batch = self._take(first)
            if batch:
                self.replicas.sent(replica)
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

    def _order(self) -> None:
        if self._ranked:  # higher priority first, then at-risk calls, least slack first; sorted() keeps the rest in order
            self._pending = deque(sorted(self._pending, key=lambda c: (-c.priority, c.slack is None, c.slack or 0.0)))

    def _first_ready(self) -> int | None:
        """The first pending call that may leave now: batches leave in order; a concurrent method's call
        waiting for the full replica that holds its prefix lets later calls by (none at risk waits)."""
        if self.concurrency is None:
            return 0
        least = self.replicas.least_loaded(most=self.concurrency)
        if least is None:
            return 0  # no replica has room: `pick` says so
        for i, call in enumerate(self._pending):
            if call.slack is not None or not self.replicas.holder_full(call.prefix, least, self.concurrency):
                return i
        return None

    def _take(self, first: int = 0) -> list[PendingCall]:
        """The next batch, from the `first` pending call on (a concurrent method's batch is that one call)."""
        if first:
            call = self._pending[first]
            del self._pending[first]
            self._pending.appendleft(call)
        batch: list[PendingCall] = []
        now = self.clock()
        while self._pending and len(batch) < self.batch_size:
            call = self._pending.popleft()
            self._ranked -= call.ranked
            if not call.future.done():
                call.dispatched = now
                self.stats.queue_wait_s += now - call.enqueued
                batch.append(call)
        return batch

    async def _send(self, replica: Replica, batch: list[PendingCall]) -> None:
        start = self.clock()
        turn: Turn | None = None
        for call in batch:
            call.batch, call.replica = len(batch), replica.id
        try:
            async with asyncio.timeout(None) as scope:
                turn = Turn(scope, self.timeout_s, self.method, batch)
                if self.concurrency is None:
                    self.replicas.line_up(replica, turn)
                else:
                    self.replicas.run_beside(replica, turn)
                outcomes = await replica.channel.run_batch(self.method, [call.envelope for call in batch])
        except WorkerDiedError as exc:
            # Behind a stuck batch on its replica, a batch never ran (a replica runs one at a time): sent
            # again, it is not retried, so a method that must not run twice (retries=0) loses no call.
            never_ran = replica.state is ReplicaState.STUCK and turn is not None and turn.started is None
            self._retry(batch, await self._death_of(replica, exc), count=not never_ran)
        except TimeoutError as exc:
            if turn is not None and turn.moved:
                self._retry(batch, WorkerDiedError(f"replica {replica.id} was replaced"), count=False)
            elif turn is not None and turn.scope.expired():
                self._timed_out(replica, batch)
            else:
                self._fail(batch, exc)
        except Exception as exc:  # not the calls' doing, nor the component's: fail them rather than leave them waiting
            self._fail(batch, exc)
        else:
            replica.served += any(map(ran, outcomes))  # a component that runs calls there is not crashing at start
            self._deliver(batch, outcomes)
            self.stats.service_s += self.clock() - start
        finally:
            self.replicas.leave(replica, turn)

    async def _death_of(self, replica: Replica, lost: WorkerDiedError) -> WorkerDiedError:
        """The error of calls whose replica died under them: `lost` (what the channel saw), or, once the
        supervisor knows (within DEATH_SEEN_S), one naming the component and the signal of a crash in native code."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(replica.gone.wait(), DEATH_SEEN_S)
        if replica.signal not in NATIVE_CRASH_SIGNALS:
            return lost
        return WorkerDiedError(
            f"{self.replicas.component}.{self.method}: replica {replica.id} was killed by {replica.signal}, a crash in "
            f"native code (a C extension the component runs, such as llama.cpp, on this machine); {DOCTOR_HINT}")

    def fail_pending(self, error: ComponentFailed) -> None:
        """Fail every queued call with `error`: its component is failed (`ReplicaSet.fail`)."""
        pending, self._pending, self._ranked = self._pending, deque(), 0
        for call in pending:
            if not call.future.done():
                call.future.set_result((False, Failure.verdict(error)))

    def _fail(self, batch: list[PendingCall], exc: Exception) -> None:
        logger.error("a batch of %s.%s failed to run", self.replicas.component, self.method, exc_info=exc)
        error = PatchkitError(f"{self.replicas.component}.{self.method}: sending its batch failed: {type(exc).__name__}: {exc}")
        self._deliver(batch, [(False, Failure.verdict(error))] * len(batch))

    def _timed_out(self, replica: Replica, batch: list[PendingCall]) -> None:
        """The batch ran past the call timeout: its replica is stuck and recycled; its calls are retried or fail."""
        where = f"{self.replicas.component}.{self.method}"
        why = f"a batch of {where} ran past its call timeout of {self.timeout_s:g} s"
        self.replicas.stuck(replica, why)
        error = DeadlineExceeded(
            f"{where} ran past its call timeout of {self.timeout_s:g} s (@make(timeout_s=...), else the deployment's "
            f"call_timeout_s); its replica {replica.id} was recycled"
        )
        self._retry(batch, error)

    def _deliver(self, batch: list[PendingCall], outcomes: list[Outcome]) -> None:
        self.stats.batches += 1
        self.stats.calls += len(batch)
        self.stats.completed(self.clock(), len(batch))
        for call, outcome in zip(batch, outcomes):
            self.stats.failures += not outcome[0]
            if not call.future.done():
                call.future.set_result(outcome)

    def _retry(self, batch: list[PendingCall], error: PatchkitError, *, count: bool = True) -> None:
        """Re-queue the calls of a dead or stuck replica at the front, in order; fail those out of retries
        with `error` (a WorkerDiedError, a DeadlineExceeded), saying how many times each was tried.
        `count`: the calls may have run; False for calls known not to have, which are re-queued whatever their retries."""
        failed = self.replicas.failed
        for call in reversed(batch):
            call.attempts += count
            if call.future.done():
                continue
            if failed is not None:
                call.future.set_result((False, Failure.verdict(failed)))
            elif call.attempts > self.max_retries:
                times = f"{call.attempts} time{'s' if call.attempts > 1 else ''}"
                final = type(error)(f"{error}; the call was tried {times} (retries: {self.max_retries})")
                call.future.set_result((False, Failure.verdict(final)))
            else:
                self.stats.retries += 1
                call.dispatched = None
                self._pending.appendleft(call)
                self._ranked += call.ranked
