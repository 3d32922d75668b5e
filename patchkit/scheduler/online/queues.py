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
up to `max_retries` times. A call whose request ends first (it timed out, its client went away)
leaves its queue at once.

A method with `max_concurrency` (an engine batching concurrent calls itself) is not batched here:
each call leaves as soon as a replica has fewer than `concurrency` of its calls in flight (its batch
size, at most `max_concurrency`), so a call arriving while others run joins them at the engine's
next step. A call whose component names a `prefix_key` (the KV state it reuses) goes to the replica
that last ran a call with that key, unless that one is busier than the least loaded by more than a
quarter of its slots (cache-aware routing). While that replica is full but no busier than that, the
call waits for its next free slot, and later calls go first where they may: moving the call would
evaluate its prefix again elsewhere, which costs more than the wait. Calls at risk never wait so.
A call asking for its chunks (a streaming output) gets them through `on_chunk` as the worker makes
them; a call whose request ends while it runs is stopped at the worker.

Liveness: a batch may run `timeout_s` (the method's `@make(timeout_s=...)`, else the deployment's
`call_timeout_s`), counted from when its replica starts it, that is once the batches sent there
before it are back. Past that the replica is stuck: it is recycled (the `recycle` callback of its
ReplicaSet: stopped, another started in its place) and the batch's calls are re-queued like those
of a dead replica, or fail with DeadlineExceeded once out of retries. A replica is stuck too when
what runs on it serves nobody: every call of its running batch (of every call running there, for a
`max_concurrency` method) belongs to a request that has ended, and it has run `abandoned_grace_s`
past the latest of those requests' deadlines. It is recycled in the same way, and the batches sent
there behind it, which it never started, go to another replica or to its replacement. One live call
running there keeps it serving: recycling it would fail that call to end one nobody waits for.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from patchkit.errors import DeadlineExceeded, PatchkitError, WorkerDiedError
from patchkit.orchestrator.backend import SERVING, STUCK, Replica
from patchkit.orchestrator.execute import Failure, Outcome

__all__ = ["BatchQueue", "PendingCall", "QueueStats", "ReplicaSet"]

logger = logging.getLogger(__name__)

THROUGHPUT_WINDOW_S = 10.0
PREFIX_MEMORY = 4096  # prefix keys remembered per component


@dataclass(eq=False)
class PendingCall:
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    future: asyncio.Future[Outcome]
    enqueued: float
    attempts: int = 0
    slack: float | None = None  # seconds to spare when its request is at risk; None when it is not
    dispatched: float | None = None  # when it last left the queue in a batch
    expires: float | None = None  # the event loop's time when its request times out; None: never
    prefix: str | None = None  # the component's prefix_key for it: routed to the replica holding that state
    on_chunk: Callable[[str], None] | None = None  # where its chunks go as they are made (a streaming output)
    trace: dict[str, str] | None = None  # its span's context for the worker (patchkit.telemetry); None: not traced

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
    """The live replicas of one component, shared by its methods' queues.

    `recycle(replica, state, why)`: called when a replica is stuck (a batch past its call timeout, or
    serving nobody); the front-end hands it to the supervisor. By default the replica is only taken out
    of dispatch. `abandoned_grace_s`: how long past the deadline of every request it serves a batch may
    run before its replica counts as stuck (None: only call timeouts make a replica stuck).
    """

    def __init__(
        self,
        component: str,
        max_inflight: int,
        recycle: Callable[[Replica, str, str], None] | None = None,
        *,
        abandoned_grace_s: float | None = None,
    ) -> None:
        self.component = component
        self.max_inflight = max_inflight
        self.replicas: list[Replica] = []
        self.queues: list[BatchQueue] = []
        self._recycle = recycle
        self.abandoned_grace_s = abandoned_grace_s
        # Per replica, its batches sent and not back, in the order it runs them: the first one runs,
        # and its call timeout runs with it; the others' start as the ones before them come back.
        self._lines: dict[Replica, list[_Turn]] = {}
        self._beside: dict[Replica, list[_Turn]] = {}  # per replica, the calls of max_concurrency methods running there
        self._holders: dict[str, Replica] = {}  # prefix key -> the replica that last ran it, least recent first
        self.prefix_hits = 0  # calls sent to the replica holding their prefix rather than the least loaded

    def add(self, replica: Replica) -> None:
        """Called by the supervisor's on_up: the replica takes calls from now on."""
        self.replicas.append(replica)
        self.kick()

    def remove(self, replica: Replica) -> None:
        if replica in self.replicas:
            self.replicas.remove(replica)

    def least_loaded(self, *, full: bool = True, most: int | None = None) -> Replica | None:
        """The alive replica with the fewest batches in flight, if one has fewer than `most` (default:
        `max_inflight`); unless the batch is `full`, only an idle replica will do."""
        best = None
        for replica in self.replicas:
            if self._has_room(replica, full, most) and (best is None or replica.inflight < best.inflight):
                best = replica
        return best

    def _has_room(self, replica: Replica, full: bool, most: int | None) -> bool:
        """Alive, with fewer than `most` (default `max_inflight`) batches in flight; idle unless the batch is `full`."""
        return replica.alive and replica.inflight < ((most or self.max_inflight) if full else 1)

    def pick(self, key: str | None, *, full: bool = True, most: int | None = None) -> Replica | None:
        """Where a batch goes: the replica that last ran a call with prefix `key`, while it has room and is
        busier than the least loaded by at most a quarter of its slots; else the least loaded."""
        least = self.least_loaded(full=full, most=most)
        if least is None or key is None:
            return least
        held = self._near_holder(key, least, most)
        chosen = least
        if held is not None and self._has_room(held, full, most):
            chosen = held
            self.prefix_hits += 1
        self._holders.pop(key, None)
        self._holders[key] = chosen
        if len(self._holders) > PREFIX_MEMORY:
            del self._holders[next(iter(self._holders))]
        return chosen

    def holder_full(self, key: str | None, least: Replica, most: int | None = None) -> bool:
        """Whether the replica that last ran prefix `key` is full, but busier than `least` (the least
        loaded) by at most a quarter of its slots: a call with that key waits for it rather than go elsewhere."""
        held = self._near_holder(key, least, most) if key is not None else None
        return held is not None and not self._has_room(held, True, most)

    def _near_holder(self, key: str, least: Replica, most: int | None) -> Replica | None:
        """The alive replica that last ran prefix `key`, if it is busier than `least` by at most a quarter of its slots."""
        held = self._holders.get(key)
        slack = max(1, (most or self.max_inflight) // 4)
        if held is None or held not in self.replicas or not held.alive or held.inflight > least.inflight + slack:
            return None
        return held

    def kick(self) -> None:
        """A slot opened or a replica joined: let the queue with the oldest call go first."""
        for queue in sorted(self.queues, key=BatchQueue.oldest):
            queue.dispatch()

    def line_up(self, replica: Replica, turn: _Turn) -> None:
        """A batch was sent to `replica`: its clock starts now if nothing runs there, else when its turn comes."""
        line = self._lines.setdefault(replica, [])
        line.append(turn)
        self._watch(replica, turn)
        if len(line) == 1:
            turn.start()

    def run_beside(self, replica: Replica, turn: _Turn) -> None:
        """A call of a `max_concurrency` method was sent to `replica`: it runs at once, beside the others."""
        self._beside.setdefault(replica, []).append(turn)
        self._watch(replica, turn)
        turn.start()

    def _watch(self, replica: Replica, turn: _Turn) -> None:
        if self.abandoned_grace_s is not None:
            turn.watch(self.abandoned_grace_s, lambda: self._check_abandoned(replica))

    def leave(self, replica: Replica, turn: _Turn) -> None:
        """A batch came back (or was given up on): the next one in its replica's line starts running,
        unless the replica is stuck (nothing runs there any more); if what still runs there serves
        nobody, the replica is stuck now."""
        turn.close()
        beside = self._beside.get(replica, [])
        if turn in beside:
            beside.remove(turn)
        if not beside:
            self._beside.pop(replica, None)
        line = self._lines.get(replica, [])
        if turn in line:
            line.remove(turn)
        if line and replica.state == SERVING:
            line[0].start()
        else:
            self._lines.pop(replica, None)
        self._check_abandoned(replica)

    def _check_abandoned(self, replica: Replica) -> None:
        """Called when a batch on `replica` has run its grace past the deadline of every request it serves,
        and when a batch leaves it: once every batch running there is such a batch, the replica is stuck."""
        running = [*self._lines.get(replica, [])[:1], *self._beside.get(replica, [])]
        if replica.state != SERVING or not running or not all(turn.abandoned for turn in running):
            return
        self.stuck(replica, _abandoned_why(self.component, running, asyncio.get_running_loop().time()))

    def stuck(self, replica: Replica, why: str) -> None:
        """A batch ran past its call timeout on `replica`, or what runs there serves nobody: take it out of
        dispatch and have it recycled."""
        if replica.state == STUCK:
            return  # another batch of it said so already
        replica.state, replica.why = STUCK, why
        self.remove(replica)
        if self._recycle is not None:
            self._recycle(replica, STUCK, why)


class _Turn:
    """One batch on its replica, from when it is sent until it is back (or given up on).

    Its call timeout starts when the replica starts it (the `scope` of its sender). Watched by its
    ReplicaSet (`watch`), it also lapses once every call of it belongs to a request that has ended
    and it has run the grace past the latest of those requests' deadlines: it then serves nobody.
    """

    def __init__(self, scope: asyncio.Timeout, timeout_s: float | None, method: str, calls: list[PendingCall]) -> None:
        self.scope = scope
        self.timeout_s = timeout_s
        self.method = method
        self.calls = calls
        self.started: float | None = None
        self.deadline: float | None = None  # the latest deadline of its calls' requests, once they have all ended
        self.abandoned = False  # it lapsed: nobody waits for it
        self._grace_s = 0.0
        self._on_lapse: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False

    def start(self) -> None:
        if self.started is None:
            self.started = asyncio.get_running_loop().time()
            if self.timeout_s is not None:
                self.scope.reschedule(self.started + self.timeout_s)
            self._arm()

    def watch(self, grace_s: float, on_lapse: Callable[[], None]) -> None:
        """Call `on_lapse` if the turn lapses. A call with no deadline (a held component's, a prefetch)
        keeps it from lapsing: then its call timeout alone bounds it."""
        if any(call.expires is None for call in self.calls):
            return
        self._grace_s, self._on_lapse = grace_s, on_lapse
        for call in self.calls:
            call.future.add_done_callback(self._ended)

    def _ended(self, _: asyncio.Future[Outcome]) -> None:
        """A call's future is done; once all are cancelled (their requests ended: nothing else settles a call
        while its batch runs), the turn serves nobody."""
        if all(call.future.cancelled() for call in self.calls):
            self.deadline = max(call.expires for call in self.calls if call.expires is not None)
            self._arm()

    def _arm(self) -> None:
        """Once it runs and serves nobody: lapse the grace after the latest deadline, or after it started,
        if later (a batch the worker reaches after its requests ended gets the grace to come back)."""
        if self._closed or self._timer is not None or self._on_lapse is None or self.started is None or self.deadline is None:
            return
        lapse = max(self.deadline, self.started) + self._grace_s
        self._timer = asyncio.get_running_loop().call_at(lapse, self._lapse)

    def _lapse(self) -> None:
        self.abandoned = True
        if self._on_lapse is not None:
            self._on_lapse()

    def close(self) -> None:
        """It is back, or given up on: it no longer lapses."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for call in self.calls:
            call.future.remove_done_callback(self._ended)


def _abandoned_why(component: str, running: list[_Turn], now: float) -> str:
    """What a replica running only batches that serve nobody is told: how far past every deadline they ran."""
    past = now - max((turn.deadline for turn in running if turn.deadline is not None), default=now)
    if len(running) == 1:
        return f"a batch of {component}.{running[0].method} ran {past:.1f} s past the deadline of every request it served"
    methods = ", ".join(sorted({f"{component}.{turn.method}" for turn in running}))
    return (f"its {len(running)} running batches ({methods}) ran {past:.1f} s or more past the deadline of every request "
            "they served")


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
        self._urgent = 0  # pending calls with a slack
        self._scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        replicas.queues.append(self)

    def __len__(self) -> int:
        return len(self._pending)

    def oldest(self) -> float:
        return self._pending[0].enqueued if self._pending else float("inf")

    def submit(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        slack: float | None = None,
        expires: float | None = None,
        *,
        prefix: str | None = None,
        on_chunk: Callable[[str], None] | None = None,
        trace: dict[str, str] | None = None,
    ) -> PendingCall:
        """Queue one call; called from a request's greenlet. Its `future` resolves to its Outcome;
        cancelling it (its request ended) takes the call out of the queue at once, or stops it where it runs.

        `slack`: the call's request is at risk with this many seconds to spare (negative: late); it
        jumps the queue ahead of calls with more slack and of every call without one. `expires`: the
        event loop's time when its request times out: a worker does not run it later than that.
        `prefix`: its component's `prefix_key` (routing); `on_chunk`: where its chunks go as they are made;
        `trace`: the context of the call's span, which its worker's execution span continues.
        """
        loop = asyncio.get_running_loop()
        call = PendingCall(args, kwargs, loop.create_future(), self.clock(), slack=slack, expires=expires,
                           prefix=prefix, on_chunk=on_chunk, trace=trace)
        call.future.add_done_callback(lambda _: self._withdraw(call))
        self._pending.append(call)
        self._urgent += slack is not None
        if not self._scheduled:
            # Calls submitted in the same loop turn (a burst of requests) leave in one batch.
            self._scheduled = True
            loop.call_soon(self.dispatch)
        return call

    def _withdraw(self, call: PendingCall) -> None:
        """Its future is done: if it was cancelled while queued, it leaves the queue now."""
        if call.future.cancelled() and call.dispatched is None:
            try:
                self._pending.remove(call)
            except ValueError:
                return  # taken in a batch in the meantime (the batch skips it), or re-queued and taken
            self._urgent -= call.slack is not None

    def dispatch(self) -> None:
        """Send every batch that may leave now; called on submit, on timers and when a slot opens."""
        self._scheduled = False
        while self._pending:
            while self._pending and self._pending[0].future.done():  # its request was cancelled
                self._urgent -= self._pending.popleft().slack is not None
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

    def _order(self) -> None:
        if self._urgent:  # at-risk calls first, least slack first; sorted() keeps the rest in order
            self._pending = deque(sorted(self._pending, key=lambda c: (c.slack is None, c.slack or 0.0)))

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
            self._urgent -= call.slack is not None
            if not call.future.done():
                call.dispatched = now
                self.stats.queue_wait_s += now - call.enqueued
                batch.append(call)
        return batch

    async def _send(self, replica: Replica, batch: list[PendingCall]) -> None:
        start = self.clock()
        now = asyncio.get_running_loop().time()
        calls = [(c.args, c.kwargs) for c in batch]
        extras: dict[str, Any] = {"ended": [c.future for c in batch]}
        if any(c.expires is not None for c in batch):
            extras["expires_in"] = [None if c.expires is None else c.expires - now for c in batch]
        if any(c.on_chunk is not None for c in batch):
            extras["on_chunk"] = [c.on_chunk for c in batch]
        if any(c.trace is not None for c in batch):
            extras["traces"] = [c.trace for c in batch]
        turn: _Turn | None = None
        try:
            async with asyncio.timeout(None) as scope:
                turn = _Turn(scope, self.timeout_s, self.method, batch)
                if self.concurrency is None:
                    self.replicas.line_up(replica, turn)
                else:
                    self.replicas.run_beside(replica, turn)
                outcomes = await replica.channel.run_batch(self.method, calls, **extras)
        except WorkerDiedError as exc:
            # Behind a stuck batch on its replica, a batch never ran (a replica runs one at a time): sent
            # again, it is not retried, so a method that must not run twice (retries=0) loses no call.
            never_ran = replica.state == STUCK and turn is not None and turn.started is None
            self._retry(batch, exc, count=not never_ran)
        except TimeoutError as exc:
            if turn is not None and turn.scope.expired():
                self._timed_out(replica, batch)
            else:
                self._fail(batch, exc)
        except Exception as exc:  # not the calls' doing, nor the component's: fail them rather than leave them waiting
            self._fail(batch, exc)
        else:
            self._deliver(batch, outcomes)
            self.stats.service_s += self.clock() - start
        finally:
            if turn is not None:
                self.replicas.leave(replica, turn)
            replica.inflight -= 1
            self.replicas.kick()

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
        for call in reversed(batch):
            call.attempts += count
            if call.future.done():
                continue
            if call.attempts > self.max_retries:
                times = f"{call.attempts} time{'s' if call.attempts > 1 else ''}"
                final = type(error)(f"{error}; the call was tried {times} (retries: {self.max_retries})")
                call.future.set_result((False, Failure.verdict(final)))
            else:
                self.stats.retries += 1
                call.dispatched = None
                self._pending.appendleft(call)
                self._urgent += call.slack is not None
