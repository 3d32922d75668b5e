"""BatchQueue dispatch on its own: how many batches a replica is given, and when."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from components import Retriever

from patchkit.orchestrator.backend import Replica, ReplicaSpec, ReplicaState
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.execute import Outcome
from patchkit.serving.queues import BatchQueue
from patchkit.serving.replicas import ReplicaSet


class HeldChannel:
    """A replica's channel whose batches finish only when the test releases them, in order."""

    def __init__(self) -> None:
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.sent: list[int] = []  # the size of each batch, in the order sent
        self.values: list[Any] = []  # each call's first argument, in the order sent
        self.held: list[asyncio.Future[None]] = []

    async def run_batch(self, method: str, calls: Sequence[CallEnvelope]) -> list[Outcome]:
        self.sent.append(len(calls))
        self.values += [call.args[0] for call in calls]
        done = asyncio.get_running_loop().create_future()
        self.held.append(done)
        await done
        return [(True, call.args[0]) for call in calls]

    def release(self) -> None:
        self.held.pop(0).set_result(None)

    async def stats(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        return None


def queue_on_one_replica(batch_size: int) -> tuple[BatchQueue, HeldChannel]:
    channel = HeldChannel()
    replicas = ReplicaSet("retriever", 2, mark_stuck)
    replicas.add(Replica("retriever-0", ReplicaSpec("retriever", Retriever()), channel))
    return BatchQueue(replicas, "retrieve", batch_size=batch_size, batch_wait_s=0.0, max_retries=0), channel


def mark_stuck(replica: Replica, why: str) -> None:
    """As the supervisor does first when a replica's set reports it stuck: it is STUCK from now on."""
    replica.state, replica.why = ReplicaState.STUCK, why


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_busy_replica_gets_no_partial_batch_so_later_calls_join_the_next() -> None:
    async def scenario() -> tuple[list[int], list[Any]]:
        queue, channel = queue_on_one_replica(batch_size=8)
        first = [queue.submit(CallEnvelope((i,), {})).future for i in range(2)]
        await settle()
        later = [queue.submit(CallEnvelope((i,), {})).future for i in range(2, 5)]  # arrive while the first batch runs
        await settle()
        assert channel.sent == [2]  # held in the queue: the replica is busy and 3 < 8
        channel.release()
        await settle()
        channel.release()
        return channel.sent, [await f for f in first + later]

    sent, outcomes = asyncio.run(scenario())
    assert sent == [2, 3]
    assert [value for _, value in outcomes] == [0, 1, 2, 3, 4]


def test_a_full_batch_takes_the_second_slot_of_a_busy_replica() -> None:
    async def scenario() -> list[int]:
        queue, channel = queue_on_one_replica(batch_size=2)
        calls = [queue.submit(CallEnvelope((i,), {})).future for i in range(2)]
        await settle()
        calls += [queue.submit(CallEnvelope((i,), {})).future for i in range(2, 6)]  # two full batches while the first runs
        await settle()
        sent = list(channel.sent)
        for _ in range(3):
            channel.release()
            await settle()
        await asyncio.gather(*calls)
        return sent

    assert asyncio.run(scenario()) == [2, 2]  # the second slot is used, the third batch waits for one


def test_a_call_waits_for_the_full_replica_holding_its_prefix_while_later_calls_go_elsewhere() -> None:
    async def scenario() -> tuple[list[Any], list[Any]]:
        channels = [HeldChannel(), HeldChannel()]
        replicas = ReplicaSet("retriever", 2, mark_stuck)
        for i, channel in enumerate(channels):
            replicas.add(Replica(f"retriever-{i}", ReplicaSpec("retriever", Retriever()), channel))
        queue = BatchQueue(replicas, "retrieve", batch_size=2, batch_wait_s=0.0, max_retries=0, concurrency=2)
        calls = []
        for value, key in (("a1", "a"), ("b1", "b"), ("a2", "a")):  # a1 and a2 on replica 0, b1 on 1
            calls.append(queue.submit(CallEnvelope((value,), {}), prefix=key).future)
            await settle()
        # replica 0 is full and replica 1 runs one call: a3 waits for replica 0, c1 (no holder) passes it
        calls += [queue.submit(CallEnvelope((value,), {}), prefix=key).future for value, key in (("a3", "a"), ("c1", "c"))]
        await settle()
        assert (channels[0].values, channels[1].values) == (["a1", "a2"], ["b1", "c1"])
        channels[0].release()
        await settle()
        for channel in channels:
            while channel.held:
                channel.release()
                await settle()
        await asyncio.gather(*calls)
        return channels[0].values, channels[1].values

    assert asyncio.run(scenario()) == (["a1", "a2", "a3"], ["b1", "c1"])


def test_a_call_at_risk_does_not_wait_for_the_replica_holding_its_prefix() -> None:
    async def scenario() -> list[Any]:
        channels = [HeldChannel(), HeldChannel()]
        replicas = ReplicaSet("retriever", 2, mark_stuck)
        for i, channel in enumerate(channels):
            replicas.add(Replica(f"retriever-{i}", ReplicaSpec("retriever", Retriever()), channel))
        queue = BatchQueue(replicas, "retrieve", batch_size=2, batch_wait_s=0.0, max_retries=0, concurrency=2)
        for value, key in (("a1", "a"), ("b1", "b"), ("a2", "a")):
            queue.submit(CallEnvelope((value,), {}), prefix=key)
            await settle()
        queue.submit(CallEnvelope(("a3",), {}), slack=0.5, prefix="a")
        await settle()
        return channels[1].values

    assert asyncio.run(scenario()) == ["b1", "a3"]
