"""Failures between the front-end and its workers, each put where it belongs, and no request left hanging.

A call whose arguments do not pickle fails alone, and a reply the front-end cannot unpickle fails its
own call, the replica serving on; a batch past its call timeout gets its replica recycled, and so does
one that runs on past the deadline of every request it serves, while one live request keeps it; a replica
that fails its health checks (a frozen process, a `check_health()` that raises) shows in `/healthz`
and stats, and is recycled; a request that times out takes its queued calls with it; a method with
`retries=0` never runs a call twice; what a component's `setup()` starts stops with its worker.
Unit tests on fakes and the inprocess backend; the failures between processes on real workers (slow).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from components import Hanger, Slow
from serving import run_frontend
from test_deploy_local import _in_threads, _join, _running, _wait_until
from test_queues import HeldChannel, mark_stuck, settle
from wire_components import Checked, Journal, Ledger, Replier, Sleeper, Spawner, argument

import patchkit
from patchkit import Component, DeadlineExceeded, MakeError, WorkerDiedError, make
from patchkit.config import DeploymentConfig
from patchkit.errors import CallError, ConfigError
from patchkit.orchestrator.backend import Replica, ReplicaSpec, ReplicaState
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.execute import Outcome
from patchkit.orchestrator.inprocess import InProcessBackend
from patchkit.orchestrator.rpc import GrpcChannel
from patchkit.orchestrator.supervisor import Supervisor
from patchkit.scheduler.online.frontend import Frontend
from patchkit.scheduler.online.queues import BatchQueue
from patchkit.scheduler.online.replicas import ReplicaSet

TESTS = Path(__file__).parent


def _get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:  # noqa: S310 - a local test server
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _replicas(endpoint: patchkit.Endpoint, component: str) -> list[dict[str, Any]]:
    replicas: list[dict[str, Any]] = endpoint.stats()["components"][component]["replicas"]
    return replicas


def _pid(endpoint: patchkit.Endpoint, component: str) -> int:
    [replica] = _replicas(endpoint, component)
    return int(replica["pid"])


def _capture(body: Callable[[str], Any], text: str = "x") -> patchkit.Pipeline:
    """The pipeline `body` captures, without running it here."""
    body(text)
    return patchkit.last_pipeline()


# -- @make's options, checked where they are given --------------------------------------------------
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"timeout_s": 0}, "timeout_s must be a positive number of seconds; got 0"),
        ({"timeout_s": -1.5}, "timeout_s must be a positive number"),
        ({"timeout_s": float("inf")}, "timeout_s must be a positive number"),
        ({"timeout_s": "5"}, "timeout_s must be a positive number of seconds; got '5'"),
        ({"timeout_s": True}, "timeout_s must be a positive number"),
        ({"retries": -1}, r"retries must be an int >= 0 \(0: never re-sent\); got -1"),
        ({"retries": 1.5}, "retries must be an int >= 0"),
        ({"retries": True}, "retries must be an int >= 0"),
    ],
)
def test_make_checks_its_timeout_and_retries_when_applied(options: dict[str, Any], message: str) -> None:
    with pytest.raises(MakeError, match=message) as raised:

        class Bad(Component):
            @make(**options)
            def run(self, x: int) -> int:
                return x

    assert "Bad.run" in str(raised.value)


def test_make_keeps_its_timeout_and_retries() -> None:
    class Careful(Component):
        @make(timeout_s=2, retries=0)
        def pay(self, amount: int) -> int:
            return amount

        @make
        def look(self, x: int) -> int:
            return x

    assert (Careful.pay.timeout_s, Careful.pay.retries) == (2.0, 0)
    assert (Careful.look.timeout_s, Careful.look.retries) == (None, None)  # the deployment's call_timeout_s, max_retries


# -- the batching queue: withdrawal and the call timeout, on a replica that holds its batches -------
class _Lines:
    """A queue of batch size 1 on one replica whose batches finish when the test releases them."""

    def __init__(self, *, timeout_s: float | None = None, max_retries: int = 0) -> None:
        self.channel = HeldChannel()
        self.recycled: list[tuple[Replica, str]] = []
        self.set = ReplicaSet("retriever", 2, self._mark_stuck)
        self.replica = Replica("retriever#0", ReplicaSpec("retriever", Slow()), self.channel)
        self.set.add(self.replica)
        self.queue = BatchQueue(self.set, "retrieve", batch_size=1, batch_wait_s=0.0, max_retries=max_retries,
                                timeout_s=timeout_s)

    def _mark_stuck(self, replica: Replica, why: str) -> None:
        mark_stuck(replica, why)
        self.recycled.append((replica, why))


def test_a_cancelled_call_leaves_its_queue_at_once() -> None:
    async def scenario() -> tuple[int, int, list[int]]:
        lines = _Lines()
        running = [lines.queue.submit(CallEnvelope((i,), {})).future for i in range(2)]  # both slots of the replica
        queued = [lines.queue.submit(CallEnvelope((i,), {})) for i in range(2, 6)]
        await settle()
        before = len(lines.queue)
        for call in queued[:3]:
            call.future.cancel()  # their requests timed out
        await asyncio.sleep(0)  # the loop turn in which a cancelled future's callbacks run
        after = len(lines.queue)
        for _ in range(3):
            lines.channel.release()
            await settle()
        await asyncio.gather(*running, queued[3].future)
        return before, after, lines.channel.sent

    before, after, sent = asyncio.run(scenario())
    assert (before, after) == (4, 1)
    assert sent == [1, 1, 1]  # the withdrawn calls never left: only the one still wanted did


def test_a_batch_past_its_call_timeout_recycles_its_replica_and_fails_its_call() -> None:
    async def scenario() -> tuple[_Lines, Outcome]:
        lines = _Lines(timeout_s=0.05)
        call = lines.queue.submit(CallEnvelope(("hangs",), {}))
        return lines, await call.future

    lines, (ok, failure) = asyncio.run(scenario())
    assert not ok
    assert isinstance(failure.error, DeadlineExceeded)
    assert "retriever.retrieve ran past its call timeout of 0.05 s" in failure.message
    assert "replica retriever#0 was recycled" in failure.message
    [(replica, why)] = lines.recycled
    assert replica is lines.replica and replica.state is ReplicaState.STUCK
    assert "ran past its call timeout" in why
    assert lines.set.replicas == []  # out of dispatch at once


def test_a_stuck_batch_is_retried_on_another_replica_when_its_method_allows() -> None:
    async def scenario() -> tuple[Outcome, _Lines, HeldChannel]:
        lines = _Lines(timeout_s=0.05, max_retries=1)
        call = lines.queue.submit(CallEnvelope(("first",), {}))
        await asyncio.sleep(0.2)  # past the timeout: the replica is recycled, the call waits for another
        assert not call.future.done()
        other = HeldChannel()
        lines.set.add(Replica("retriever#1", ReplicaSpec("retriever", Slow()), other))
        await settle()
        other.release()
        return await call.future, lines, other

    outcome, lines, other = asyncio.run(scenario())
    assert outcome == (True, "first")
    assert lines.queue.stats.retries == 1 and other.sent == [1]


def test_a_batch_s_call_timeout_starts_when_its_replica_starts_it() -> None:
    """Two batches sent to one replica: the second waits for the first, and its clock only starts then."""

    async def scenario() -> tuple[list[Outcome], list[Any]]:
        lines = _Lines(timeout_s=2.5)
        calls = [lines.queue.submit(CallEnvelope((i,), {})).future for i in range(2)]
        await settle()
        for _ in range(2):
            await asyncio.sleep(1.5)  # each batch runs 1.5 s: the second is back 3 s after it was sent
            lines.channel.release()
        return list(await asyncio.gather(*calls)), lines.recycled

    outcomes, recycled = asyncio.run(scenario())
    assert outcomes == [(True, 0), (True, 1)] and recycled == []


# -- a batch that serves nobody: every request it serves has ended, and their deadlines have passed -----
class _Wedged:
    """A replica's channel that runs one batch at a time (`serial`, as a worker runs a method without
    max_concurrency) or all at once: a call whose value starts with "hang" returns only when the test releases
    it, the others at once; once killed (as a recycled replica's process is), its batches fail with WorkerDiedError."""

    def __init__(self, *, serial: bool) -> None:
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.sizes: list[int] = []  # each batch's size, in the order sent
        self.values: list[Any] = []  # each call's first argument, in the order sent
        self._held: dict[Any, asyncio.Future[None]] = {}
        self._turn = asyncio.Lock() if serial else None

    async def run_batch(self, method: str, calls: Sequence[CallEnvelope]) -> list[Outcome]:
        self.sizes.append(len(calls))
        self.values += [call.args[0] for call in calls]
        async with self._turn or contextlib.nullcontext():
            if self.lost.is_set():
                raise WorkerDiedError("the replica was killed")
            loop = asyncio.get_running_loop()
            hung = [call.args[0] for call in calls if str(call.args[0]).startswith("hang")]
            await asyncio.gather(*(self._held.setdefault(value, loop.create_future()) for value in hung))
        return [(True, call.args[0]) for call in calls]

    def release(self, value: Any) -> None:
        self._held.pop(value).set_result(None)

    def kill(self) -> None:
        self.lost_reason = "killed"
        self.lost.set()
        for held in self._held.values():
            if not held.done():
                held.set_exception(WorkerDiedError("the replica was killed"))

    async def stats(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        return None


class _Recycled:
    """One queue of `llm.generate` on its replicas, a stuck one replaced as the supervisor does: one past a call
    timeout killed at once and another started on the next turn of the loop; one whose batches serve nobody
    replaced as a surge, another started on the next turn and the old one killed once its set says it may be."""

    def __init__(self, *, batch_size: int = 1, concurrency: int | None = None, grace_s: float = 0.05) -> None:
        self.recycled: list[tuple[str, str]] = []
        self.channels: list[_Wedged] = []
        self.events: list[str] = []  # "started llm#1", "killed llm#0", in the order they happened
        self.queue_concurrency = concurrency
        self.set = ReplicaSet("llm", 2, self._recycle, abandoned_grace_s=grace_s, surge=self._surge)
        self._start()
        self.queue = BatchQueue(self.set, "generate", batch_size=batch_size, batch_wait_s=0.0, max_retries=0,
                                concurrency=concurrency)

    def _start(self) -> None:
        self.channels.append(_Wedged(serial=self.queue_concurrency is None))
        replica_id = f"llm#{len(self.channels) - 1}"
        self.set.add(Replica(replica_id, ReplicaSpec("llm", Slow()), self.channels[-1]))
        self.events.append(f"started {replica_id}")

    def _kill(self, replica: Replica) -> None:
        self.channels[int(replica.id.split("#")[1])].kill()
        self.events.append(f"killed {replica.id}")

    def _recycle(self, replica: Replica, why: str) -> None:
        mark_stuck(replica, why)
        self.recycled.append((replica.id, why))
        self._kill(replica)
        asyncio.get_running_loop().call_soon(self._start)

    def _surge(self, replica: Replica, why: str, retired: asyncio.Future[None]) -> None:
        mark_stuck(replica, why)
        self.recycled.append((replica.id, why))
        asyncio.get_running_loop().call_soon(self._start)
        retired.add_done_callback(lambda _: self._kill(replica))


ABANDONED = r"a batch of llm\.generate ran past the deadline of every request it served"


def test_a_batch_that_serves_only_ended_requests_is_replaced_at_once_and_the_batch_behind_it_moves() -> None:
    """No call timeout at all: the running batch's request ended at its deadline, so its replica is replaced at
    once (a surge), and the batch lined up behind it, never started, is answered by the replacement while the
    stuck one still runs; the stuck one is killed once its grace has passed."""

    async def scenario() -> tuple[_Recycled, Outcome, list[str]]:
        pool = _Recycled(grace_s=5.0)
        now = asyncio.get_running_loop().time()
        hung = pool.queue.submit(CallEnvelope(("hang",), {}, expires=now + 0.1))
        behind = pool.queue.submit(CallEnvelope(("next",), {}, expires=now + 60))  # a live request, lined up on the same replica
        await asyncio.sleep(0.1)
        hung.future.cancel()  # its request timed out
        outcome = await asyncio.wait_for(behind.future, 10)
        events_when_answered = list(pool.events)
        await asyncio.wait_for(pool.channels[0].lost.wait(), 10)  # then the grace ends
        return pool, outcome, events_when_answered

    pool, outcome, events_when_answered = asyncio.run(scenario())
    [(replica, why)] = pool.recycled
    assert replica == "llm#0" and re.fullmatch(ABANDONED, why), why
    assert outcome == (True, "next")  # with max_retries=0: it never ran on the stuck replica, so it was sent again
    assert [c.values for c in pool.channels] == [["hang", "next"], ["next"]]  # answered by the replacement
    assert events_when_answered == ["started llm#0", "started llm#1"]  # before the stuck one was stopped
    assert pool.events == ["started llm#0", "started llm#1", "killed llm#0"]


def test_a_replica_whose_batch_serves_nobody_gets_no_second_batch() -> None:
    """Calls made after the hung batch's request ended wait for the replacement, though the stuck replica
    has a free slot (max_inflight_batches=2), and the stuck one is stopped as soon as its batch is back."""

    async def scenario() -> tuple[_Recycled, list[Outcome]]:
        pool = _Recycled(grace_s=60.0)
        now = asyncio.get_running_loop().time()
        hung = pool.queue.submit(CallEnvelope(("hang",), {}, expires=now + 0.05))
        await asyncio.sleep(0.05)
        hung.future.cancel()
        later = [pool.queue.submit(CallEnvelope((f"later-{i}",), {}, expires=now + 60)).future for i in range(3)]
        outcomes = await asyncio.wait_for(asyncio.gather(*later), 10)
        pool.channels[0].release("hang")  # its batch comes back long before the grace ends
        await asyncio.wait_for(pool.channels[0].lost.wait(), 10)
        return pool, list(outcomes)

    pool, outcomes = asyncio.run(scenario())
    assert outcomes == [(True, f"later-{i}") for i in range(3)]
    assert [c.values for c in pool.channels] == [["hang"], ["later-0", "later-1", "later-2"]]
    assert pool.events == ["started llm#0", "started llm#1", "killed llm#0"]


def test_a_batch_with_a_live_request_keeps_its_replica_until_that_request_ends_too() -> None:
    async def scenario() -> tuple[list[Any], list[Any]]:
        pool = _Recycled(batch_size=2)
        now = asyncio.get_running_loop().time()
        first = pool.queue.submit(CallEnvelope(("hang-1",), {}, expires=now + 0.05))
        second = pool.queue.submit(CallEnvelope(("hang-2",), {}, expires=now + 0.3))
        await asyncio.sleep(0.05)
        assert pool.channels[0].sizes == [2]  # one batch
        first.future.cancel()
        await asyncio.sleep(0.2)  # well past the first's deadline and the grace
        while_the_second_waits = list(pool.recycled)
        second.future.cancel()
        await asyncio.sleep(0.2)  # past the second's deadline and the grace
        return while_the_second_waits, pool.recycled

    while_live, after = asyncio.run(scenario())
    assert while_live == []
    [(replica, why)] = after
    assert replica == "llm#0" and re.fullmatch(ABANDONED, why), why


def test_a_batch_its_replica_reaches_after_its_requests_ended_gets_the_grace_to_come_back() -> None:
    """Its deadlines passed while it waited behind another batch: the grace counts from when it starts."""

    async def scenario() -> list[Any]:
        pool = _Recycled(grace_s=0.2)
        now = asyncio.get_running_loop().time()
        running = pool.queue.submit(CallEnvelope(("hang-1",), {}, expires=now + 60))
        behind = pool.queue.submit(CallEnvelope(("hang-2",), {}, expires=now + 0.05))
        await asyncio.sleep(0.05)
        behind.future.cancel()  # its request timed out while it waited
        await asyncio.sleep(0.35)  # past its deadline and the grace
        pool.channels[0].release("hang-1")
        await running.future
        await settle()  # the replica starts the batch behind: the worker finds its call cancelled
        pool.channels[0].release("hang-2")
        await asyncio.sleep(0.3)
        return pool.recycled

    assert asyncio.run(scenario()) == []


def test_a_replica_running_a_live_call_beside_an_abandoned_one_serves_on_until_the_live_one_is_back() -> None:
    """A `max_concurrency` method: recycling the replica would fail the live call to end one nobody waits for."""

    async def scenario() -> tuple[list[Any], Outcome, list[Any]]:
        pool = _Recycled(batch_size=2, concurrency=2)
        now = asyncio.get_running_loop().time()
        abandoned = pool.queue.submit(CallEnvelope(("hang-1",), {}, expires=now + 0.05))
        live = pool.queue.submit(CallEnvelope(("hang-2",), {}, expires=now + 60))
        await asyncio.sleep(0.05)
        abandoned.future.cancel()
        await asyncio.sleep(0.2)
        beside_a_live_call = list(pool.recycled)
        pool.channels[0].release("hang-2")
        outcome = await live.future
        await settle()
        return beside_a_live_call, outcome, pool.recycled

    beside_a_live_call, outcome, after = asyncio.run(scenario())
    assert beside_a_live_call == [] and outcome == (True, "hang-2")
    [(replica, why)] = after  # once back, only the abandoned call runs there
    assert replica == "llm#0" and re.fullmatch(ABANDONED, why), why


def test_a_surge_starts_the_replacement_first_and_stops_the_old_replica_when_it_is_retired_or_at_close() -> None:
    """The supervisor's side of a surge, on the inprocess backend: the replacement serves while the old replica
    still runs; the old one stops once its set says it may (`retired`), and close() stops one still waiting."""

    async def scenario() -> tuple[list[str], list[str], list[str], list[str]]:
        backend = InProcessBackend()
        serving: list[str] = []
        supervisor = Supervisor(backend, lambda r: serving.append(r.id), lambda r, why: serving.remove(r.id))
        await supervisor.start([ReplicaSpec("slow", Slow()), ReplicaSpec("slow", Slow())])
        first, second = supervisor.replicas()
        retired: list[asyncio.Future[None]] = [asyncio.get_running_loop().create_future() for _ in range(2)]
        supervisor.surge(first, "a batch of slow.echo ran past the deadline of every request it served", retired[0])
        supervisor.surge(second, "a batch of slow.echo ran past the deadline of every request it served", retired[1])
        while len(serving) < 2:
            await asyncio.sleep(0.01)
        surged = sorted(r.id for r in backend.replicas())  # the replacements serve; the old ones still run
        retired[0].set_result(None)
        while first in backend.replicas():
            await asyncio.sleep(0.01)
        after_retired = sorted(r.id for r in backend.replicas())
        await asyncio.wait_for(supervisor.close(), 10)  # the second old replica's batch never came back
        return sorted(serving), surged, after_retired, [r.id for r in backend.replicas()]

    serving, surged, after_retired, after_close = asyncio.run(scenario())
    assert serving == ["slow#2", "slow#3"]
    assert surged == ["slow#0", "slow#1", "slow#2", "slow#3"]
    assert after_retired == ["slow#1", "slow#2", "slow#3"]
    assert after_close == []


def test_abandoned_grace_s_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="abandoned_grace_s must be > 0; got 0"):
        DeploymentConfig.check_options({"abandoned_grace_s": 0})


# -- the stream's reader: whatever ends it, the replica is lost with the reason, never silently ------
class _GarbledStream:
    """A worker's stream that answers with a message that is not a reply at all."""

    def __init__(self) -> None:
        self.written: list[bytes] = []

    async def write(self, message: bytes) -> None:
        self.written.append(message)

    async def read(self) -> bytes:
        await asyncio.sleep(0.01)
        return b"\x00\x01"  # shorter than a reply's header

    def cancel(self) -> None:
        return None


def test_a_stream_reader_that_fails_loses_its_channel_with_the_reason() -> None:
    async def scenario() -> tuple[BaseException | None, bool, str]:
        channel = GrpcChannel("127.0.0.1:9", "secret")  # nothing listens there: the stream is the fake's
        channel._call = _GarbledStream()
        channel._reader = asyncio.get_running_loop().create_task(channel._read())
        try:
            await asyncio.wait_for(channel.run_batch("echo", [CallEnvelope(("x",), {})]), 10)
        except (WorkerDiedError, TimeoutError) as exc:  # a silent death: the batch would wait forever
            error: BaseException | None = exc
        else:
            error = None
        lost = channel.lost.is_set()
        await channel.close()
        return error, lost, channel.lost_reason

    error, lost, reason = asyncio.run(scenario())
    assert isinstance(error, WorkerDiedError) and "its stream failed: error: unpack_from requires" in str(error)
    assert lost and reason.startswith("its stream failed")


# -- health on the inprocess backend: /healthz and stats report a replica failing its checks ----------
class Moody(Component):
    def __init__(self) -> None:
        self.unwell = False

    def check_health(self) -> None:
        if self.unwell:
            raise RuntimeError("the index went away")

    @make
    def echo(self, text: str) -> str:
        return text


moody = Moody()


def test_a_replica_failing_its_health_checks_is_reported_then_recycled() -> None:
    def body(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return moody.echo(text)  # type: ignore[no-any-return]
        return pipeline

    async def scenario(frontend: Frontend) -> tuple[bool, dict[str, Any], bool, int]:
        assert frontend.healthy()
        moody.unwell = True
        while not frontend.deployment.supervisor.replicas()[0].failed_checks:
            await asyncio.sleep(0.01)
        failing = frontend.healthy(), frontend.stats()["components"]["moody"]["replicas"][0]
        assert frontend.readiness().status == "unready"
        while frontend.deployment.supervisor.restarts == 0:  # the third failure in a row recycles it
            await asyncio.sleep(0.01)
        moody.unwell = False
        while not frontend.healthy():
            await asyncio.sleep(0.01)
        assert frontend.readiness().ready
        return *failing, frontend.healthy(), frontend.deployment.supervisor.restarts

    healthy, described, recovered, restarts = run_frontend(
        _capture(body), scenario, health_check_period_s=0.02, health_check_timeout_s=1, health_check_failures=3
    )
    assert not healthy
    assert described["state"] == "serving" and described["health"].startswith("failing: ")
    assert "RuntimeError: the index went away" in described["health"]
    assert recovered and restarts >= 1


# -- between processes: errors attributed to their cause --------------------------------------------
slow = Slow(seconds=0.01)


@pytest.mark.slow
def test_an_argument_that_does_not_pickle_fails_its_own_call_only() -> None:
    def body(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return slow.nap(argument(text))  # type: ignore[no-any-return]
        return pipeline

    texts = ["unpicklable"] + [f"ordinary {i}" for i in range(11)]
    with patchkit.deploy(_capture(body), batch_wait_ms=300) as endpoint:  # the twelve share a batch
        pid = _pid(endpoint, "slow")
        threads, results = _in_threads(lambda i: endpoint.query(text=texts[i]), len(texts))
        _join(threads)
        stats = endpoint.stats()
    bad = results[0]
    assert isinstance(bad, CallError), repr(bad)
    assert (bad.component, bad.method) == ("slow", "nap")
    assert "its arguments cannot be sent to the worker: they do not pickle" in str(bad)
    assert {i: results[i] for i in range(1, 12)} == {i: texts[i][::-1] for i in range(1, 12)}
    assert stats["restarts"] == 0 and stats["components"]["slow"]["methods"]["nap"]["retries"] == 0
    assert [r["pid"] for r in stats["components"]["slow"]["replicas"]] == [pid]


@pytest.mark.slow
def test_a_reply_the_front_end_cannot_unpickle_fails_its_call_and_the_replica_serves_on() -> None:
    replier = Replier()

    def body(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return replier.reply(text)  # type: ignore[no-any-return]
        return pipeline

    with patchkit.deploy(_capture(body), request_timeout_s=60) as endpoint:
        pid = _pid(endpoint, "replier")
        with pytest.raises(CallError, match="replier.reply: its reply from the worker cannot be unpickled by the front-end: "
                           "ValueError: this reply cannot be read here"):
            endpoint.query(text="unreadable")
        assert [endpoint.query(text=f"next {i}") for i in range(3)] == [f"NEXT {i}" for i in range(3)]
        [replica] = _replicas(endpoint, "replier")
        assert replica["pid"] == pid and replica["alive"] and replica["state"] == "serving"
        assert endpoint.stats()["restarts"] == 0


# -- between processes: liveness --------------------------------------------------------------------
@pytest.mark.slow
def test_a_call_past_its_timeout_recycles_its_replica_and_the_calls_behind_it_are_answered() -> None:
    sleeper = Sleeper()

    def body(text: str) -> patchkit.Pipeline:
        seconds = 0.0
        with patchkit.capture(run=False) as pipeline:
            return sleeper.wait(seconds)  # type: ignore[no-any-return]
        return pipeline

    with patchkit.deploy(_capture(body), request_timeout_s=120, autoscale=False) as endpoint:
        pid = _pid(endpoint, "sleeper")
        hung, hung_result = _in_threads(lambda i: endpoint.query(seconds=600.0), 1)
        _wait_until(lambda: _replicas(endpoint, "sleeper")[0]["inflight_batches"] == 1, "the hanging call was sent")
        behind, behind_results = _in_threads(lambda i: endpoint.query(seconds=0.0), 3)  # one waits on the worker, two queue
        _join(hung + behind)
        error = hung_result[0]
        assert isinstance(error, DeadlineExceeded), repr(error)
        assert "sleeper.wait ran past its call timeout of 1 s" in str(error)
        assert "recycled" in str(error) and "tried 1 time (retries: 0)" in str(error)
        assert behind_results == {0: 0.0, 1: 0.0, 2: 0.0}  # never run on the stuck replica: sent again despite retries=0
        assert endpoint.stats()["restarts"] == 1
        assert _pid(endpoint, "sleeper") != pid
        _wait_until(lambda: not _running(pid), "the stuck worker was killed")
        assert _get(endpoint.url + "/healthz")[0] == 200


hanger = Hanger()
ORDINARY = 19  # requests after the hung one, each with 2 s to be answered


@pytest.mark.slow
def test_a_call_that_outlives_its_request_has_its_only_replica_replaced_with_no_request_failing() -> None:
    """The hung call's request times out: its replica gets nothing more and its replacement starts at once, so
    every request after it is answered (a worker starts well within their 2 s); the stuck worker is stopped
    once its grace has passed."""

    def body(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return hanger.echo(text)  # type: ignore[no-any-return]
        return pipeline

    with patchkit.deploy(_capture(body), request_timeout_s=2, abandoned_grace_s=5, autoscale=False) as endpoint:
        pid = _pid(endpoint, "hanger")
        with pytest.raises(DeadlineExceeded):
            endpoint.query(text="hang")
        answers: list[Any] = []
        for i in range(ORDINARY):
            try:
                answers.append(endpoint.query(text=f"after {i}"))
            except DeadlineExceeded as exc:
                answers.append(exc)
            if i == 0:
                still_running = _running(pid)  # answered within its 2 s: the grace of 5 s has not ended
        assert answers == [f"AFTER {i}" for i in range(ORDINARY)]
        assert still_running, "the stuck worker was stopped before its replacement served"
        stats = endpoint.stats()
        assert stats["restarts"] == 1 and _pid(endpoint, "hanger") != pid
        [replaced] = stats["components"]["hanger"]["replaced"]
        assert replaced["state"] == "stuck"
        assert replaced["why"] == "a batch of hanger.echo ran past the deadline of every request it served", replaced
        _wait_until(lambda: not _running(pid), "the stuck worker was killed")


@pytest.mark.slow
def test_close_during_a_replaced_replica_s_grace_stops_it_too() -> None:
    def body(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return hanger.echo(text)  # type: ignore[no-any-return]
        return pipeline

    with patchkit.deploy(_capture(body), request_timeout_s=2, abandoned_grace_s=600, autoscale=False) as endpoint:
        stuck = _pid(endpoint, "hanger")
        with pytest.raises(DeadlineExceeded):
            endpoint.query(text="hang")
        assert endpoint.query(text="after") == "AFTER"  # answered by the replacement
        replacement = _pid(endpoint, "hanger")
        assert _running(stuck), "the stuck worker was stopped before its grace ended"
    _wait_until(lambda: not _running(stuck) and not _running(replacement), "close() stopped both workers", 15)


@pytest.mark.slow
def test_a_call_moved_off_a_replaced_replica_is_never_started_there(tmp_path: Path) -> None:
    """A slow call outlives its request (3 s): its replica is replaced at once, and the call lined up behind it
    on that worker moves. The slow call comes back at 3.8 s while the moved call's request still runs: the old
    worker, told the moved call is not its own any more, skips it, so a `retries=0` call cannot run twice."""
    path = tmp_path / "ledger.txt"
    path.write_text("")
    ledger = Ledger(str(path))

    def body(text: str) -> patchkit.Pipeline:
        seconds = 0.0
        with patchkit.capture(run=False) as pipeline:
            return ledger.run(text, seconds)  # type: ignore[no-any-return]
        return pipeline

    with patchkit.deploy(_capture(body), request_timeout_s=3, abandoned_grace_s=5, autoscale=False) as endpoint:
        old = _pid(endpoint, "ledger")
        slow_call, _ = _in_threads(lambda i: endpoint.query(text="first", seconds=3.8), 1)
        _wait_until(lambda: path.read_text(), "the slow call started")
        time.sleep(1.5)  # the next request's deadline (4.5 s) falls after the slow call comes back (3.8 s)
        behind, behind_result = _in_threads(lambda i: endpoint.query(text="second", seconds=0.0), 1)
        _join(slow_call + behind)
        _wait_until(lambda: not _running(old), "the replaced worker was stopped")
        [replaced] = endpoint.stats()["components"]["ledger"]["replaced"]
    runs = [line.split() for line in path.read_text().splitlines()]
    assert runs[0] == ["first", str(old)]
    moved = [pid for text, pid in runs if text == "second"]  # on the replacement, if it started in time
    assert str(old) not in moved, "the replaced worker started the call moved off it"
    assert len(moved) <= 1
    assert replaced["why"] == "a batch of ledger.run ran past the deadline of every request it served"
    assert behind_result[0] == "SECOND" or isinstance(behind_result[0], DeadlineExceeded), behind_result


@pytest.mark.slow
def test_a_frozen_worker_fails_its_health_checks_and_is_recycled() -> None:
    with patchkit.deploy(_capture(_echo), health_check_period_s=0.2, health_check_timeout_s=0.5,
                         health_check_failures=2, autoscale=False) as endpoint:
        pid = _pid(endpoint, "slow")
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait_until(lambda: endpoint.stats()["restarts"] >= 1, "the frozen replica was recycled")
            assert _pid(endpoint, "slow") != pid
            _wait_until(lambda: not _running(pid), "the frozen worker was killed")
        finally:
            if _running(pid):
                os.kill(pid, signal.SIGCONT)
        assert endpoint.query(text="after") == "AFTER"
        assert _get(endpoint.url + "/healthz")[0] == 200


def _echo(text: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        return slow.echo(text)  # type: ignore[no-any-return]
    return pipeline


@pytest.mark.slow
def test_readyz_and_stats_report_a_replica_whose_check_health_raises_and_healthz_stays_200(tmp_path: Path) -> None:
    flag = tmp_path / "unwell"
    checked = Checked(str(flag))

    def body(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return checked.echo(text)  # type: ignore[no-any-return]
        return pipeline

    with patchkit.deploy(_capture(body), health_check_period_s=0.1, health_check_failures=10_000) as endpoint:
        assert _get(endpoint.url + "/readyz")[0] == 200
        flag.touch()
        status, reply = _wait_until(lambda: (s := _get(endpoint.url + "/readyz"))[0] == 503 and s, "/readyz said 503")
        assert reply["status"] == "unready"
        [reason] = reply["reasons"]
        assert re.fullmatch(r"checked#0 failed its last \d+ health checks", reason), reason
        status, health = _get(endpoint.url + "/healthz")  # the process answers: liveness holds
        assert status == 200 and health["status"] == "ok" and health["workers"] == "degraded"
        [replica] = _replicas(endpoint, "checked")
        assert replica["health"].startswith("failing: ")
        assert f"check_health() raised RuntimeError: {flag} says I am unwell" in replica["health"]
        assert endpoint.query(text="still") == "STILL"  # failing checks, below the threshold: it still serves
        flag.unlink()
        _wait_until(lambda: _get(endpoint.url + "/readyz")[0] == 200, "/readyz said 200 again")
        assert _replicas(endpoint, "checked")[0]["health"] == "ok"
        assert _get(endpoint.url + "/healthz")[1]["workers"] == "ok"


@pytest.mark.slow
def test_a_timed_out_request_s_call_is_not_run_later(tmp_path: Path) -> None:
    journal_path = tmp_path / "journal.txt"
    journal_path.write_text("")
    journal = Journal(str(journal_path), seconds=3.0)

    def body(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return journal.again(text)  # type: ignore[no-any-return]
        return pipeline

    with patchkit.deploy(_capture(body), request_timeout_s=1.5, autoscale=False) as endpoint:
        first, first_result = _in_threads(lambda i: endpoint.query(text="first"), 1)
        _wait_until(lambda: journal_path.read_text(), "the first call started")
        late, late_results = _in_threads(lambda i: endpoint.query(text=f"late-{i}"), 3)  # one on the wire, two queued
        _join(first + late)
        assert all(isinstance(r, DeadlineExceeded) for r in [*first_result.values(), *late_results.values()])
        assert endpoint.stats()["components"]["journal"]["methods"]["again"]["queue_length"] == 0
        _wait_until(lambda: _replicas(endpoint, "journal")[0]["inflight_batches"] == 0, "the worker was done")
        # The first call ran on past its request's deadline: its replica was replaced, and stopped once it was back.
        [replaced] = endpoint.stats()["components"]["journal"]["replaced"]
        assert replaced["why"] == "a batch of journal.again ran past the deadline of every request it served"
    assert journal_path.read_text().split() == ["first"]  # none of the late ones ran


# -- between processes: retries ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(("method", "runs", "answered"), [("once", 1, False), ("again", 2, True)])
def test_a_call_of_a_method_with_retries_0_never_runs_twice(tmp_path: Path, method: str, runs: int, answered: bool) -> None:
    journal_path = tmp_path / "journal.txt"
    journal_path.write_text("")
    journal = Journal(str(journal_path), seconds=3.0)

    def once(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return journal.once(text)  # type: ignore[no-any-return]
        return pipeline

    def again(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return journal.again(text)  # type: ignore[no-any-return]
        return pipeline

    with patchkit.deploy(_capture(once if method == "once" else again), autoscale=False) as endpoint:
        pid = _pid(endpoint, "journal")
        threads, results = _in_threads(lambda i: endpoint.query(text="pay"), 1)
        _wait_until(lambda: journal_path.read_text(), "the call started")
        os.kill(pid, signal.SIGKILL)
        _join(threads)
    assert journal_path.read_text().split() == ["pay"] * runs
    if answered:  # the default: re-sent to the restarted replica, so it ran twice
        assert results[0] == "PAY"
    else:
        assert isinstance(results[0], WorkerDiedError) and "tried 1 time (retries: 0)" in str(results[0])


# -- between processes: a worker's process group stops with it --------------------------------------
def _gone(pid: int) -> bool:
    return not _running(pid)


def _spawner_pids(pid_file: Path) -> tuple[int, int]:
    """(the setup() subprocess, its worker), once the worker has written them."""
    text = _wait_until(lambda: pid_file.exists() and pid_file.read_text().count("\n") == 1 and pid_file.read_text(),
                       "setup() started its subprocess")
    child, worker = text.split()
    return int(child), int(worker)


@pytest.mark.slow
def test_a_subprocess_started_by_setup_stops_with_close_and_with_its_worker(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    spawner = Spawner(str(pid_file))

    def body(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return spawner.echo(text)  # type: ignore[no-any-return]
        return pipeline

    with patchkit.deploy(_capture(body), autoscale=False) as endpoint:
        first, worker = _spawner_pids(pid_file)
        assert _running(first) and endpoint.query(text="hi") == "HI"
        pid_file.unlink()
        os.kill(worker, signal.SIGKILL)  # its lifeline cannot stop the group: the front-end does
        _wait_until(lambda: _gone(first), "the killed worker's subprocess stopped")
        second, _ = _spawner_pids(pid_file)  # the restarted replica's
        assert _running(second)
    assert _gone(second), "close() left the subprocess of setup() running"


SPAWNER_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, {tests!r})
    import patchkit
    from wire_components import Spawner

    spawner = Spawner({pid_file!r})
    text = "x"
    with patchkit.capture(run=False) as pipeline:
        answer = spawner.echo(text)
    endpoint = patchkit.deploy(pipeline)
    print(json.dumps({{"answer": endpoint.query(text="hello")}}), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slow
def test_a_subprocess_started_by_setup_stops_when_the_user_process_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    script = SPAWNER_SCRIPT.format(tests=str(TESTS), pid_file=str(pid_file))
    user = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert user.stdout is not None
    try:
        ready, _, _ = select.select([user.stdout], [], [], 120)
        assert ready and json.loads(user.stdout.readline())["answer"] == "HELLO"
        child, worker = _spawner_pids(pid_file)
        assert _running(child) and _running(worker)
        user.send_signal(signal.SIGKILL)
        user.wait()
        _wait_until(lambda: _gone(worker) and _gone(child), "the worker and its subprocess stopped", 15)
    finally:
        if user.poll() is None:
            user.kill()
            user.wait()
        user.stdout.close()

