"""`ReplicaSet`: the replicas of one component in service, the batches each runs, and when one is stuck.

Shared by the component's batching queues. It sends batches where its `Router` says, counts each
replica's batches in flight, and keeps per replica the line of batches sent there: a replica runs one
at a time, so a batch's call timeout starts when the one ahead of it comes back (a `max_concurrency`
method's calls run beside each other, each timed from when it is sent).

Liveness: past its call timeout a batch's replica is stuck; it is stuck too when what runs there
serves nobody: every call of its running batch (of every call running there, for a `max_concurrency`
method) belongs to a request that has ended, and it has run `abandoned_grace_s` past the latest of
those requests' deadlines. One live call running there keeps it serving: recycling it would fail that
call to end one nobody waits for. A stuck replica leaves dispatch at once and is reported to its
owner (`mark_stuck`: the supervisor, which writes its state and recycles it); the batches lined up
behind it, which it never started, go to another replica or to its replacement.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from patchkit.orchestrator.backend import Replica, ReplicaState
from patchkit.orchestrator.execute import Outcome
from patchkit.scheduler.online.router import Router

if TYPE_CHECKING:
    from patchkit.scheduler.online.queues import BatchQueue, PendingCall

__all__ = ["ReplicaSet", "Turn"]


class ReplicaSet:
    """The live replicas of one component, shared by its methods' queues.

    `mark_stuck(replica, why)`: called once when a replica is stuck (a batch past its call timeout, or
    serving nobody); the deployment hands it to the supervisor, which marks it STUCK and recycles it.
    `abandoned_grace_s`: how long past the deadline of every request it serves a batch may run before
    its replica counts as stuck (None: only call timeouts make a replica stuck).
    """

    def __init__(
        self,
        component: str,
        max_inflight: int,
        mark_stuck: Callable[[Replica, str], None],
        *,
        abandoned_grace_s: float | None = None,
    ) -> None:
        self.component = component
        self.router: Router[Replica] = Router(max_inflight)
        self.replicas: list[Replica] = []
        self.queues: list[BatchQueue] = []
        self._mark_stuck = mark_stuck
        self.abandoned_grace_s = abandoned_grace_s
        # Per replica, its batches sent and not back, in the order it runs them: the first one runs,
        # and its call timeout runs with it; the others' start as the ones before them come back.
        self._lines: dict[Replica, list[Turn]] = {}
        self._beside: dict[Replica, list[Turn]] = {}  # per replica, the calls of max_concurrency methods running there

    def add(self, replica: Replica) -> None:
        """Called by the supervisor's on_up: the replica takes calls from now on."""
        self.replicas.append(replica)
        self.kick()

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
        else:
            self._lines.pop(replica, None)
        self._check_abandoned(replica)

    def _check_abandoned(self, replica: Replica) -> None:
        """Called when a batch on `replica` has run its grace past the deadline of every request it serves,
        and when a batch leaves it: once every batch running there is such a batch, the replica is stuck."""
        running = [*self._lines.get(replica, [])[:1], *self._beside.get(replica, [])]
        if replica.state is not ReplicaState.SERVING or not running or not all(turn.abandoned for turn in running):
            return
        self.stuck(replica, _abandoned_why(self.component, running, asyncio.get_running_loop().time()))

    def stuck(self, replica: Replica, why: str) -> None:
        """A batch ran past its call timeout on `replica`, or what runs there serves nobody: take it out of
        dispatch and report it, once."""
        if replica.state is not ReplicaState.SERVING:
            return  # another batch of it said so already, or it is being replaced
        self.remove(replica)
        self._mark_stuck(replica, why)


class Turn:
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
        if any(call.envelope.expires is None for call in self.calls):
            return
        self._grace_s, self._on_lapse = grace_s, on_lapse
        for call in self.calls:
            call.future.add_done_callback(self._ended)

    def _ended(self, _: asyncio.Future[Outcome]) -> None:
        """A call's future is done; once all are cancelled (their requests ended: nothing else settles a call
        while its batch runs), the turn serves nobody."""
        if all(call.future.cancelled() for call in self.calls):
            self.deadline = max(call.envelope.expires for call in self.calls if call.envelope.expires is not None)
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


def _abandoned_why(component: str, running: list[Turn], now: float) -> str:
    """What a replica running only batches that serve nobody is told: how far past every deadline they ran."""
    past = now - max((turn.deadline for turn in running if turn.deadline is not None), default=now)
    if len(running) == 1:
        return f"a batch of {component}.{running[0].method} ran {past:.1f} s past the deadline of every request it served"
    methods = ", ".join(sorted({f"{component}.{turn.method}" for turn in running}))
    return (f"its {len(running)} running batches ({methods}) ran {past:.1f} s or more past the deadline of every request "
            "they served")
