"""`ReplicaSet`: the replicas of one component in service, the batches each runs, and when one is stuck.

Shared by the component's batching queues. It sends batches where its `Router` says, counts each
replica's batches in flight, and keeps per replica the line of batches sent there: a replica runs one
at a time, so a batch's call timeout starts when the one ahead of it comes back (a `max_concurrency`
method's calls run beside each other, each timed from when it is sent).

Liveness: past its call timeout a batch's replica is stuck, and stopped at once. A replica is stuck
too when what runs there serves nobody: every call of its running batch (of every call running
there, for a `max_concurrency` method) belongs to a request that has ended, and it runs on past the
latest of those requests' deadlines. One live call running there keeps it serving: recycling it
would fail that call to end one nobody waits for. Such a replica is replaced as a surge, the way an
update replaces workers: it leaves dispatch at once (no second batch reaches it), the batches lined
up behind it, which it never started, move at once to another replica or wait for its replacement,
and its owner (`surge`: the supervisor) starts the replacement at once; the replica itself is
stopped once its running batches are back, or once they have run `abandoned_grace_s` more.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from patchkit.errors import ComponentFailed
from patchkit.orchestrator.backend import Replica, ReplicaState
from patchkit.orchestrator.execute import Outcome
from patchkit.serving.router import Router

if TYPE_CHECKING:
    from patchkit.serving.queues import BatchQueue, PendingCall

__all__ = ["ReplicaSet", "Surge", "Turn"]

# Called with a replica whose running batches serve nobody, why, and a future done once it may be stopped.
Surge = Callable[[Replica, str, asyncio.Future[None]], None]


class ReplicaSet:
    """The live replicas of one component, shared by its methods' queues.

    `mark_stuck(replica, why)`: called once when a batch ran past its call timeout there; the deployment
    hands it to the supervisor, which marks it STUCK and recycles it at once.
    `surge(replica, why, retired)`: called once when what runs on a replica serves nobody (see the module's
    docstring), after it left dispatch; the supervisor marks it STUCK, starts its replacement at once and
    stops it when `retired` is done. None: it is handed to `mark_stuck` then instead.
    `abandoned_grace_s`: how long such a replica's batches may run on once it is replaced (None: only call
    timeouts make a replica stuck).
    """

    def __init__(
        self,
        component: str,
        max_inflight: int,
        mark_stuck: Callable[[Replica, str], None],
        *,
        abandoned_grace_s: float | None = None,
        surge: Surge | None = None,
    ) -> None:
        self.component = component
        self.router: Router[Replica] = Router(max_inflight)
        self.replicas: list[Replica] = []
        self.queues: list[BatchQueue] = []
        self._mark_stuck = mark_stuck
        self._surge = surge or self._stop_when_retired
        self.abandoned_grace_s = abandoned_grace_s
        # Per replica, its batches sent and not back, in the order it runs them: the first one runs,
        # and its call timeout runs with it; the others' start as the ones before them come back.
        self._lines: dict[Replica, list[Turn]] = {}
        self._beside: dict[Replica, list[Turn]] = {}  # per replica, the calls of max_concurrency methods running there
        self._retiring: dict[Replica, asyncio.Future[None]] = {}  # replaced as a surge: done once it may be stopped
        self.failed: ComponentFailed | None = None  # set by `fail`: its calls fail at once with it

    def add(self, replica: Replica) -> None:
        """Called by the supervisor's on_up: the replica takes calls from now on."""
        self.replicas.append(replica)
        self.kick()

    def fail(self, why: str) -> None:
        """Called when the supervisor failed this component (its replicas crash at every start): every call
        queued for it, and every call submitted until `revive`, fails at once with ComponentFailed(why)."""
        self.failed = ComponentFailed(why)
        for queue in self.queues:
            queue.fail_pending(self.failed)

    def revive(self) -> None:
        """Its replicas are being started again (an update): calls queue for them again."""
        self.failed = None

    def remove(self, replica: Replica) -> None:
        """Called by the supervisor's on_down, and here when a replica is stuck: it takes no more calls."""
        if replica in self.replicas:
            self.replicas.remove(replica)

    # -- routing: the router's policy over the replicas in service ------------------------------------------
    def pick(self, key: str | None, *, full: bool = True, most: int | None = None) -> Replica | None:
        """The replica the next batch goes to (see `Router.pick`); None while none has room."""
        return self.router.pick(self.replicas, key, full=full, most=most)

    def least_loaded(self, *, most: int | None = None) -> Replica | None:
        return self.router.least_loaded(self.replicas, most=most)

    def holder_full(self, key: str | None, least: Replica, most: int | None = None) -> bool:
        """Whether a call with prefix `key` waits for its full holder (see `Router.holder_full`)."""
        return self.router.holder_full(self.replicas, key, least, most)

    def kick(self) -> None:
        """A slot opened or a replica joined: let the queue with the oldest call go first."""
        for queue in sorted(self.queues, key=lambda queue: queue.oldest()):
            queue.dispatch()

    # -- batches in flight ----------------------------------------------------------------------------------
    def sent(self, replica: Replica) -> None:
        """A queue chose `replica` for a batch: one more in flight there, until `leave`."""
        replica.inflight += 1

    def line_up(self, replica: Replica, turn: Turn) -> None:
        """A batch was sent to `replica`: its clock starts now if nothing runs there, else when its turn comes."""
        line = self._lines.setdefault(replica, [])
        line.append(turn)
        self._watch(replica, turn)
        if len(line) == 1:
            turn.start()

    def run_beside(self, replica: Replica, turn: Turn) -> None:
        """A call of a `max_concurrency` method was sent to `replica`: it runs at once, beside the others."""
        self._beside.setdefault(replica, []).append(turn)
        self._watch(replica, turn)
        turn.start()

    def _watch(self, replica: Replica, turn: Turn) -> None:
        if self.abandoned_grace_s is not None:
            turn.watch(self.abandoned_grace_s, lambda: self._check_abandoned(replica))

    def leave(self, replica: Replica, turn: Turn | None) -> None:
        """A batch came back (or was given up on): one fewer in flight; the next one in its replica's line
        starts running, unless the replica is out of service (nothing runs there any more); if what still
        runs there serves nobody, the replica is stuck now. Then every queue may send again."""
        replica.inflight -= 1
        if turn is not None:
            self._leave_line(replica, turn)
        self.kick()

    def _leave_line(self, replica: Replica, turn: Turn) -> None:
        turn.close()
        beside = self._beside.get(replica, [])
        if turn in beside:
            beside.remove(turn)
        if not beside:
            self._beside.pop(replica, None)
        line = self._lines.get(replica, [])
        if turn in line:
            line.remove(turn)
        if line and replica.state is ReplicaState.SERVING:
            line[0].start()
        elif not line:
            self._lines.pop(replica, None)
        self._check_abandoned(replica)

    def _running(self, replica: Replica) -> list[Turn]:
        """The batches `replica` runs now: the first of its line, and every call running beside."""
        return [*self._lines.get(replica, [])[:1], *self._beside.get(replica, [])]

    def _check_abandoned(self, replica: Replica) -> None:
        """Called when a batch on `replica` comes to serve nobody, when one lapses, and when one leaves: once
        every batch running there serves nobody, the replica is replaced as a surge; once a replaced one's
        running batches are all back or lapsed, it may be stopped."""
        running = self._running(replica)
        if replica in self._retiring:
            if all(turn.lapsed for turn in running):
                retired = self._retiring.pop(replica)
                if not retired.done():
                    retired.set_result(None)
            return
        if replica.state is not ReplicaState.SERVING or not running or not all(turn.abandoned for turn in running):
            return
        self._abandon(replica, running)

    def _abandon(self, replica: Replica, running: list[Turn]) -> None:
        """Take `replica` out of dispatch, move the batches lined up behind what runs there, and hand it to
        the supervisor, which starts its replacement now and stops it once `_check_abandoned` says so."""
        self.remove(replica)
        for turn in self._lines.get(replica, [])[1:]:
            turn.move()
        self._retiring[replica] = asyncio.get_running_loop().create_future()
        self._surge(replica, _abandoned_why(self.component, running), self._retiring[replica])
        self._check_abandoned(replica)  # a batch reached after its deadlines lapses as it comes to serve nobody

    def _stop_when_retired(self, replica: Replica, why: str, retired: asyncio.Future[None]) -> None:
        """With no `surge` owner: the replica is handed to `mark_stuck` once it may be stopped."""
        retired.add_done_callback(lambda _: self._mark_stuck(replica, why))

    def stuck(self, replica: Replica, why: str) -> None:
        """A batch ran past its call timeout on `replica`: take it out of dispatch and report it, once."""
        if replica.state is not ReplicaState.SERVING or replica in self._retiring:
            return  # another batch of it said so already, or it is being replaced
        self.remove(replica)
        self._mark_stuck(replica, why)


class Turn:
    """One batch on its replica, from when it is sent until it is back (or given up on).

    Its call timeout starts when the replica starts it (the `scope` of its sender). Watched by its
    ReplicaSet (`watch`), it comes to serve nobody (`abandoned`) once every call of it belongs to a
    request that has ended and it runs on past the latest of those requests' deadlines (a batch the
    replica reaches after them gets the grace first: the worker skips calls whose request ended);
    it `lapsed` once it ran the grace more.
    """

    def __init__(self, scope: asyncio.Timeout, timeout_s: float | None, method: str, calls: list[PendingCall]) -> None:
        self.scope = scope
        self.timeout_s = timeout_s
        self.method = method
        self.calls = calls
        self.started: float | None = None
        self.deadline: float | None = None  # the latest deadline of its calls' requests, once they have all ended
        self.abandoned = False  # it serves nobody: its replica is replaced
        self.lapsed = False  # it ran the grace past that: its replica is stopped
        self.moved = False  # given up on before it started, its calls sent elsewhere
        self._grace_s = 0.0
        self._on_change: Callable[[], None] | None = None
        self._timers: list[asyncio.TimerHandle] = []
        self._closed = False

    def start(self) -> None:
        if self.started is None:
            self.started = asyncio.get_running_loop().time()
            if self.timeout_s is not None:
                self.scope.reschedule(self.started + self.timeout_s)
            self._arm()

    def watch(self, grace_s: float, on_change: Callable[[], None]) -> None:
        """Call `on_change` when the turn comes to serve nobody and when it lapses. A call with no deadline
        (a held component's, a prefetch) keeps it serving: then its call timeout alone bounds it."""
        if any(call.envelope.expires is None for call in self.calls):
            return
        self._grace_s, self._on_change = grace_s, on_change
        for call in self.calls:
            call.future.add_done_callback(self._ended)

    def move(self) -> None:
        """Its replica is replaced before it started this batch: give it up now (its sender re-queues its calls
        as never run; cancelling the send tells the worker to skip them)."""
        self.moved = True
        self.scope.reschedule(asyncio.get_running_loop().time())

    def _ended(self, _: asyncio.Future[Outcome]) -> None:
        """A call's future is done; once all are cancelled (their requests ended: nothing else settles a call
        while its batch runs), the turn may come to serve nobody."""
        if all(call.future.cancelled() for call in self.calls):
            self.deadline = max(call.envelope.expires for call in self.calls if call.envelope.expires is not None)
            self._arm()

    def _arm(self) -> None:
        """Once it runs and all its requests ended: it serves nobody from the latest deadline on (from the
        grace after it started, if it started later), and lapses the grace after that deadline or its start."""
        if self._closed or self._timers or self._on_change is None or self.started is None or self.deadline is None:
            return
        loop = asyncio.get_running_loop()
        lapse = max(self.deadline, self.started) + self._grace_s
        abandon = lapse if self.started > self.deadline else self.deadline
        self._timers = [loop.call_at(lapse, self._lapse)]
        if abandon > loop.time():
            self._timers.append(loop.call_at(abandon, self._abandon))
        else:  # now, before a call queued in this turn of the loop is sent there
            self._abandon()

    def _abandon(self) -> None:
        self.abandoned = True
        if self._on_change is not None:
            self._on_change()

    def _lapse(self) -> None:
        self.abandoned = self.lapsed = True
        if self._on_change is not None:
            self._on_change()

    def close(self) -> None:
        """It is back, or given up on: it no longer changes."""
        self._closed = True
        for timer in self._timers:
            timer.cancel()
        for call in self.calls:
            call.future.remove_done_callback(self._ended)


def _abandoned_why(component: str, running: list[Turn]) -> str:
    """What a replica running only batches that serve nobody is told."""
    if len(running) == 1:
        return f"a batch of {component}.{running[0].method} ran past the deadline of every request it served"
    methods = ", ".join(sorted({f"{component}.{turn.method}" for turn in running}))
    return f"its {len(running)} running batches ({methods}) ran past the deadline of every request they served"
