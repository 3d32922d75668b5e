"""Keeps every component at its replica count: starts replicas, watches them, checks their health,
restarts the dead, recycles the stuck and the unhealthy, and adds or retires replicas when the
autoscaler asks. The one owner of each replica's `ReplicaState`: others report (`mark_stuck`,
`surge`), it writes. A replica is replaced in one of two orders: stopped, then another started (dead,
unhealthy, past a call timeout), or, for one whose running batches serve only ended requests, another
started at once while it keeps running until its batches are back or its grace ends (a surge).

Owned by the front-end, on its event loop. The front-end hears of replicas through two callbacks:
`on_up(replica)` once one takes calls, `on_down(replica, reason)` once one takes no more: it is
gone (its in-flight batches have failed with WorkerDiedError by then, and the front-end retries
them elsewhere), it is being recycled (stuck or unhealthy: it is stopped, and its batches in
flight fail the same way), or it is being retired (reason "retired": its in-flight batches still
finish).

A replica killed by a signal from its own native code (SIGSEGV, SIGILL, SIGBUS: a C extension crashing
on this CPU) before it served a batch is restarted after a growing delay, not in a tight loop; after
CRASHES_TO_FAIL such deaths in a row, with no replica of the component serving a batch between them, the
component is failed: nothing of it is restarted, `on_failed(component, why)` tells the front-end (which
then answers its calls at once with ComponentFailed), and it stays so until `revive` (an update) or a new
version replaces it. So is a component none of whose replicas is kept once RESTARTS_TO_FAIL restarts in a
row could not start (its `setup()` raises at every start): while another replica of it serves, its restarts
go on, with backoff. The deployment fails a component the same way when it cannot start at all (`mark_failed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import defaultdict, deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from patchkit.crashes import NATIVE_CRASH_SIGNALS
from patchkit.orchestrator.backend import Backend, Replica, ReplicaSpec, ReplicaState

__all__ = ["NATIVE_CRASHES", "RESTARTS_FAILED", "HealthChecks", "Replacement", "Supervisor"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
CRASH_BACKOFF_S = (1.0, 4.0)  # before restarting a replica whose predecessors crashed in native code: 1 crash, 2 or more
CRASHES_TO_FAIL = 3  # native crashes in a row, no replica of the component serving a batch between, that fail it
RESTARTS_TO_FAIL = 5  # restarts in a row that could not start, no replica of the component kept meanwhile, that fail it
NATIVE_CRASHES = "its replicas die by a signal in native code at every start"  # what the probes say of the first
RESTARTS_FAILED = "its replicas died and could not be started again"  # and of the second
DOCTOR_HINT = "run `patchkit doctor` on this machine to see which part fails"
DRAIN_POLL_S = 0.01  # how often a retiring replica is checked for batches still in flight
REPLACED_MEMORY = 64  # replacements remembered for stats, the latest kept


@dataclass(frozen=True)
class HealthChecks:
    """Every `period_s`, each replica must answer within `timeout_s` with its component's
    `check_health()` passing; after `failures` failed checks in a row it is recycled (as Ray Serve's)."""

    period_s: float = 10.0
    timeout_s: float = 30.0
    failures: int = 3


@dataclass(frozen=True)
class Replacement:
    """A replica taken out of service and replaced: dead, stuck or unhealthy (`state`), and why."""

    id: str
    component: str
    state: ReplicaState
    why: str
    at: float  # when, as time.time()

    def describe(self) -> dict[str, str | float]:
        """As stats report it, under its component."""
        return {"id": self.id, "state": self.state.value, "why": self.why, "at": self.at}


class Supervisor:
    def __init__(
        self,
        backend: Backend,
        on_up: Callable[[Replica], None],
        on_down: Callable[[Replica, str], None],
        *,
        drain_timeout_s: float = 30.0,
        health: HealthChecks | None = None,
        on_failed: Callable[[str, str], None] | None = None,
    ) -> None:
        """`health`: the checks every replica gets (None: the defaults of HealthChecks). `on_failed(component,
        why)`: called once a component is failed (see the module's docstring)."""
        self.backend = backend
        self._on_up = on_up
        self._on_down = on_down
        self._on_failed = on_failed
        self.drain_timeout_s = drain_timeout_s  # how long a retiring replica gets to send its batches back
        self.health = health or HealthChecks()
        self._numbers: dict[str, itertools.count[int]] = defaultdict(itertools.count)
        self._keepers: dict[Replica, asyncio.Task[None]] = {}  # watching a live replica: safe to cancel
        self._replacing: list[Replica] = []  # dead, stuck or unhealthy, until another serves in its place
        # Restarting, adding or retiring: may be spawning or stopping a process, so awaited, never cancelled.
        self._busy: set[asyncio.Task[Any]] = set()
        self._closing = asyncio.Event()
        self._gone: set[str] = set()  # components that left the deployment: none of their replicas starts again
        self.restarts = 0
        self.failed: dict[str, str] = {}  # component -> why it is failed (its error text included): nothing of it starts
        self.failure_kinds: dict[str, str] = {}  # component -> what kind of failure, with no error text: for the probes
        self._crashes: dict[str, int] = {}  # component -> its replicas' native crashes in a row
        self.replaced: deque[Replacement] = deque(maxlen=REPLACED_MEMORY)  # the latest last; retired replicas are not

    def replicas(self, component: str | None = None) -> list[Replica]:
        return [r for r in self._keepers if component is None or r.component == component]

    def replacing(self, component: str | None = None) -> list[Replica]:
        """The replicas out of service (dead, stuck, unhealthy) until the one started in place of each serves."""
        return [r for r in self._replacing if component is None or r.component == component]

    async def start(self, specs: list[ReplicaSpec]) -> None:
        """Start every replica concurrently; if one cannot start, stop those that did and raise its error."""
        self._gone.difference_update(spec.component for spec in specs)
        results = await asyncio.gather(*(self._start(spec) for spec in specs), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            retired = [self.retire(r) for r in results if isinstance(r, Replica)]  # none has a batch yet: stopped at once
            await asyncio.gather(*(stopped for stopped in retired if stopped is not None), return_exceptions=True)
            raise errors[0]

    async def start_apart(self, specs: list[ReplicaSpec]) -> dict[str, Exception]:
        """Start every replica concurrently, each component's apart: of a component whose replica cannot start, those
        that did are stopped and its error returned, by component name; the others' serve. Raises a cancellation."""
        groups: dict[str, list[ReplicaSpec]] = {}
        for spec in specs:
            groups.setdefault(spec.component, []).append(spec)
        results = await asyncio.gather(*(self.start(group) for group in groups.values()), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result
        return {name: result for name, result in zip(groups, results, strict=True) if isinstance(result, Exception)}

    def forget(self, components: list[str]) -> list[asyncio.Future[None]]:
        """Retire every replica of `components`, which leave the deployment, and start none of theirs again
        (a replacement under way stops once up); returns the futures of their stops (see `retire`)."""
        self._gone.update(components)
        for name in components:  # a later component of one of these names starts afresh
            self.failed.pop(name, None)
            self.failure_kinds.pop(name, None)
            self._crashes.pop(name, None)
        retiring = [self.retire(replica) for replica in list(self._keepers) if replica.component in components]
        return [stopped for stopped in retiring if stopped is not None]

    async def _start(self, spec: ReplicaSpec, replacing: Replica | None = None) -> Replica:
        """Start a replica and put it in service; `replacing`: the one it takes the place of, out of
        `replacing()` from the moment it serves."""
        replica_id = f"{spec.component}#{next(self._numbers[spec.component])}"
        replica = await self.backend.start(spec, replica_id)
        if self._closing.is_set() or spec.component in self._gone or spec.component in self.failed:
            await self.backend.stop(replica)
            raise asyncio.CancelledError
        self._keepers[replica] = asyncio.get_running_loop().create_task(self._keep(replica))
        if replacing in self._replacing:
            self._replacing.remove(replacing)
        self._on_up(replica)
        return replica

    async def _keep(self, replica: Replica) -> None:
        checks = asyncio.get_running_loop().create_task(self._check(replica))
        try:
            reason = await self.backend.watch(replica)
        finally:
            checks.cancel()
        if self._closing.is_set() or self._keepers.pop(replica, None) is None:
            return
        crashes = self._count_crash(replica)
        if crashes >= CRASHES_TO_FAIL:
            self._fail(replica, reason, crashes)
            return
        delay = CRASH_BACKOFF_S[min(crashes, len(CRASH_BACKOFF_S)) - 1] if crashes else 0.0
        if crashes:
            reason = f"{reason}; {DOCTOR_HINT}"
        logger.warning("replica %s of %s died (%s); restarting it%s", replica.id, replica.component, reason,
                       f" in {delay:g} s" if delay else "")
        self._replace(replica, ReplicaState.DEAD, reason, delay=delay)

    def _count_crash(self, dead: Replica) -> int:
        """`dead`'s component's native crashes in a row, `dead`'s counted: a crash counts while no replica of the
        component has served a batch (`served`); any other death starts the count again."""
        component = dead.component
        serving = dead.served or any(r.served for r in self._keepers if r.component == component)
        if dead.signal not in NATIVE_CRASH_SIGNALS or serving:
            self._crashes.pop(component, None)
            return 0
        self._crashes[component] = self._crashes.get(component, 0) + 1
        return self._crashes[component]

    def _fail(self, dead: Replica, reason: str, crashes: int) -> None:
        """Fail `dead`'s component: record why, retire its other replicas and tell the front-end (`on_failed`)."""
        component = dead.component
        why = (f"{component} is failed: {crashes} of its replicas in a row died by {dead.signal}, a crash in native code, "
               f"before serving a call (the last: {reason}); it is not restarted until it is replaced or the deployment "
               f"is updated; {DOCTOR_HINT}")
        logger.error("%s", why)
        dead.state, dead.why = ReplicaState.DEAD, why
        dead.gone.set()
        self.replaced.append(Replacement(dead.id, component, ReplicaState.DEAD, why, time.time()))
        self._on_down(dead, why)
        self.mark_failed(component, why, NATIVE_CRASHES)
        self._track(self.backend.stop(dead))

    def mark_failed(self, component: str, why: str, kind: str) -> None:
        """Fail `component` (see the module's docstring): none of its replicas starts again, those running are
        retired, and `on_failed` tells the front-end. `why`: what its calls answer (error text included); `kind`:
        what the probes, which ask no token, say of it. Called here after its crashes and its failed restarts,
        and by the deployment when it could not start at deploy, or an update's try to start it again failed."""
        self.failed[component] = why
        self.failure_kinds[component] = kind
        for replica in [r for r in self._keepers if r.component == component]:
            self.retire(replica)
        if self._on_failed is not None:
            self._on_failed(component, why)

    def revive(self, components: list[str]) -> list[str]:
        """Take the failed ones of `components` out of `failed`, their crash counts cleared; returns them, whose
        replicas the caller starts again (`start`). Called when the deployment is updated."""
        revived = [name for name in components if self.failed.pop(name, None) is not None]
        for name in revived:
            self.failure_kinds.pop(name, None)
            self._crashes.pop(name, None)
        return revived

    async def _check(self, replica: Replica) -> None:
        """Check the replica's health every period, until it is recycled or its keeper ends."""
        checks = self.health
        while replica.alive:
            await asyncio.sleep(checks.period_s)
            try:
                async with asyncio.timeout(checks.timeout_s):
                    await replica.channel.health(checks.timeout_s)
            except Exception as exc:
                replica.failed_checks += 1
                replica.check_error = _check_error(exc, checks.timeout_s)
                logger.warning("replica %s failed a health check (%d in a row): %s", replica.id, replica.failed_checks,
                               replica.check_error)
                if replica.failed_checks >= checks.failures:
                    why = f"it failed {replica.failed_checks} health checks in a row; the last: {replica.check_error}"
                    self.recycle(replica, ReplicaState.UNHEALTHY, why)
                    return
            else:
                replica.failed_checks, replica.check_error = 0, ""

    def mark_stuck(self, replica: Replica, why: str) -> None:
        """A replica's `ReplicaSet` saw a batch run past its call timeout there: it is STUCK from now on, and
        recycled at once (see `recycle`). One whose batches serve nobody is replaced as a surge (`surge`)."""
        self.recycle(replica, ReplicaState.STUCK, why)

    def recycle(self, replica: Replica, state: ReplicaState, why: str) -> None:
        """Take a stuck or unhealthy replica out of dispatch, stop it (its process is killed, its batches
        in flight fail with WorkerDiedError and are retried elsewhere) and start another in its place.

        Called through `mark_stuck` (STUCK) and by the health checks (UNHEALTHY); `why` is logged, and shown
        in stats (in `replaced` after the replica is gone). A replica that is not kept here (already dying,
        retired, or the supervisor is closing) is only marked, so that its set stops dispatching to it.
        """
        keeper = None if self._closing.is_set() else self._keepers.pop(replica, None)
        if keeper is None:
            if replica.state is ReplicaState.SERVING:
                replica.state, replica.why = state, why
            return
        keeper.cancel()
        logger.warning("replica %s is %s (%s); recycling it", replica.id, state.value, why)
        self._replace(replica, state, why)

    def surge(self, replica: Replica, why: str, retired: asyncio.Future[None]) -> None:
        """Replace a stuck replica that may still finish what it runs: called by its `ReplicaSet` when every
        batch running there serves only requests that have ended, once it has left dispatch.

        It is STUCK from now on and its replacement starts at once (a surge: for a while both run), while
        it keeps its process until `retired` is done (its batches are back, or ran `abandoned_grace_s`
        more) or the supervisor closes; then it is stopped. A replica not kept here is only marked.
        """
        keeper = None if self._closing.is_set() else self._keepers.pop(replica, None)
        if keeper is None:
            if replica.state is ReplicaState.SERVING:
                replica.state, replica.why = ReplicaState.STUCK, why
            return
        keeper.cancel()  # stopping it later is no death to restart
        logger.warning("replica %s is stuck (%s); starting its replacement, then stopping it", replica.id, why)
        self._replace(replica, ReplicaState.STUCK, why, retired)

    def _replace(
        self, replica: Replica, state: ReplicaState, why: str, retired: asyncio.Future[None] | None = None, *,
        delay: float = 0.0,
    ) -> None:
        """Record `replica` as out of service, then start another in its place: after stopping it (and `delay`
        seconds more), or, with `retired`, at once, stopping it once `retired` is done."""
        replica.state, replica.why = state, why
        replica.gone.set()
        self.replaced.append(Replacement(replica.id, replica.component, state, why, time.time()))
        self._replacing.append(replica)
        self._on_down(replica, why)
        if retired is None:
            self._track(self._restart(replica, delay))
        else:
            self._track(self._stop_when(replica, retired))
            self._track(self._start_in_place_of(replica))

    async def _stop_when(self, replica: Replica, retired: asyncio.Future[None]) -> None:
        closing: asyncio.Future[Any] = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait([retired, closing], return_when=asyncio.FIRST_COMPLETED)
        finally:
            closing.cancel()
        await self.backend.stop(replica)

    async def _restart(self, dead: Replica, delay: float = 0.0) -> None:
        try:
            await self.backend.stop(dead)
        finally:
            await self._start_in_place_of(dead, delay)

    async def _start_in_place_of(self, dead: Replica, delay: float = 0.0) -> None:
        """Start a replica of `dead`'s spec, after `delay` s, trying again with backoff until one serves or the
        supervisor closes."""
        try:
            for attempt in itertools.count():
                backoff = max(delay, RESTART_BACKOFF_S[min(attempt, len(RESTART_BACKOFF_S) - 1)])
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._closing.wait(), backoff)
                if self._closing.is_set() or dead.component in self._gone:
                    return
                try:
                    await self._start(dead.spec, replacing=dead)
                except asyncio.CancelledError:
                    return
                except Exception as exc:
                    logger.error("restarting a replica of %s failed (attempt %d): %s", dead.component, attempt + 1, exc)
                    if attempt + 1 >= RESTARTS_TO_FAIL and not self.replicas(dead.component):
                        self._fail_restarts(dead.component, attempt + 1, exc)
                        return
                else:
                    self.restarts += 1
                    return
        finally:
            if dead in self._replacing:
                self._replacing.remove(dead)

    def _fail_restarts(self, component: str, attempts: int, error: Exception) -> None:
        """Fail `component`, none of whose replicas is kept, after its `attempts` restarts in a row could not start."""
        why = (f"{component} is failed: its replicas died and {attempts} restarts in a row could not start (the last: "
               f"{type(error).__name__}: {error}); it is not restarted until it is replaced or the deployment is updated")
        logger.error("%s", why)
        self.mark_failed(component, why, RESTARTS_FAILED)

    async def add(self, spec: ReplicaSpec) -> Replica:
        """Start one more replica of `spec.component`; called by the autoscaler while the deployment serves.

        It joins dispatch through `on_up` and is watched and restarted like the replicas `start`
        started. Raises the backend's error, with nothing left running. Cancelling the caller does
        not stop a start under way: the replica then joins all the same (or `close` stops it).
        """
        return await asyncio.shield(self._track(self._start(spec)))

    def retire(self, replica: Replica) -> asyncio.Future[None] | None:
        """Take a replica out of dispatch at once, then stop it with no failed call; called by the
        autoscaler. Returns a future done once it is drained and stopped (cancelling a waiter does
        not cancel that), or None if the replica is not kept here (it died and is being restarted,
        or the supervisor is closing): then nothing is done.

        In order: its watch ends, so that stopping it is not taken for a death (no restart, not
        counted in `restarts`); `on_down(replica, "retired")` takes it out of dispatch before this
        returns; then, in a task of its own that `close` waits for, its batches in flight come back
        (`drain_timeout_s` at most: those still out then fail with WorkerDiedError and are retried
        on other replicas), and it is stopped.
        """
        keeper = None if self._closing.is_set() else self._keepers.pop(replica, None)
        if keeper is None:
            return None
        keeper.cancel()
        self._on_down(replica, "retired")
        return asyncio.shield(self._track(self._drain_and_stop(replica, keeper)))

    async def _drain_and_stop(self, replica: Replica, keeper: asyncio.Task[None]) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await keeper
        deadline = asyncio.get_running_loop().time() + self.drain_timeout_s
        # Batches come back on their senders' tasks, which count `inflight` down: polled, as Ray
        # Serve's graceful shutdown polls its ongoing requests.
        while replica.inflight and replica.alive and not self._closing.is_set():
            if asyncio.get_running_loop().time() >= deadline:
                logger.warning("retiring %s with %d batches still in flight after %.0f s; they are retried elsewhere",
                               replica.id, replica.inflight, self.drain_timeout_s)
                break
            await asyncio.sleep(DRAIN_POLL_S)
        await self.backend.stop(replica)
        replica.gone.set()

    def _track(self, work: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(work)
        self._busy.add(task)
        task.add_done_callback(self._busy.discard)
        return task

    async def close(self) -> None:
        """Stop every replica; nothing is started, restarted or retired after this is called."""
        self._closing.set()
        await asyncio.gather(*self._busy, return_exceptions=True)
        keepers, self._keepers = self._keepers, {}
        for keeper in keepers.values():
            keeper.cancel()
        for keeper in keepers.values():
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        await asyncio.gather(*(self.backend.stop(r) for r in keepers), return_exceptions=True)
        for replica in keepers:
            replica.gone.set()
        await self.backend.close()


def _check_error(exc: Exception, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
