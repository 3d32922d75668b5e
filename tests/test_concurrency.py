"""The runtime of engines that batch internally, on worker processes: calls taken as they arrive up to
`max_concurrency`, chunks of a streaming output sent as they are made, requests that end stopping
their calls where they run, and calls routed to the replica holding their prefix."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from serving import run_frontend

import patchkit
from patchkit import Component, make
from patchkit.scheduler.online.frontend import Frontend

pytestmark = pytest.mark.slow  # every test here starts worker processes


class Meeting(Component):
    """Each call waits until `parties` calls are running on its replica at once."""

    def __init__(self, parties: int) -> None:
        self.parties = parties

    def setup(self) -> None:
        self.barrier = threading.Barrier(self.parties, timeout=20)

    @make(max_concurrency=4)
    def meet(self, name: str) -> str:
        self.barrier.wait()
        return f"met {name}"


class Alone(Component):
    """The same without max_concurrency: a replica runs one call at a time, so the barrier breaks."""

    def setup(self) -> None:
        self.barrier = threading.Barrier(2, timeout=2)

    @make
    def meet(self, name: str) -> str:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            return f"alone {name}"
        return f"met {name}"


class Teller(Component):
    """Streams words, one chunk each, `pause_s` apart; counts the streams closed before their end."""

    def __init__(self, pause_s: float = 0.0) -> None:
        self.pause_s = pause_s

    def setup(self) -> None:
        self.closed_early = 0
        self.finished = 0

    @make(stream=True, max_concurrency=8, read_only=True)
    def tell(self, text: str) -> Iterator[str]:
        done = False
        try:
            for i, word in enumerate(text.split()):
                time.sleep(self.pause_s)
                yield word if i == 0 else " " + word
            done = True
        finally:
            self.finished += done
            self.closed_early += not done

    def stats(self) -> dict[str, Any]:
        return {"closed_early": self.closed_early, "finished": self.finished}


class Keyed(Component):
    """Answers with its process id; its calls' prefix key is their `group`."""

    @make(max_concurrency=4)
    def where(self, group: str, n: int) -> int:
        return os.getpid()

    def prefix_key(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        return str(args[0])


def serve(pipeline: patchkit.Pipeline, body: Callable[[Frontend], Awaitable[Any]], **options: Any) -> Any:
    """A Frontend on worker processes (the local backend), `body(frontend)` run on its loop."""
    return run_frontend(pipeline, body, backend="local", **options)


def slow_telling() -> patchkit.Pipeline:
    """`teller.tell(text)` of a Teller that takes 0.2 s a word: long enough to give up on midway."""
    teller = Teller(pause_s=0.2)
    text = "x"
    with patchkit.capture(run=False) as pipeline:
        return teller.tell(text)  # type: ignore[no-any-return]
    return pipeline


def met(component: Meeting | Alone, name: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        return component.meet(name)
    return pipeline


async def meet_all(frontend: Frontend, count: int) -> list[Any]:
    return [r.output for r in await asyncio.gather(*(frontend.query({"name": str(i)}) for i in range(count)))]


def test_a_concurrent_method_runs_calls_together_on_one_replica() -> None:
    pipeline = met(Meeting(4), "x")
    assert serve(pipeline, lambda f: meet_all(f, 4)) == [f"met {i}" for i in range(4)]  # the barrier of 4 opened


def test_a_method_without_concurrency_runs_one_call_at_a_time() -> None:
    pipeline = met(Alone(), "x")
    assert serve(pipeline, lambda f: meet_all(f, 2)) == ["alone 0", "alone 1"]


def test_the_output_streams_its_chunks_as_they_are_made_and_equals_the_answer() -> None:
    teller = Teller()

    def told(text: str) -> patchkit.Pipeline:
        with patchkit.capture() as pipeline:
            return teller.tell(text)
        return pipeline

    assert told("one two three") == "one two three"  # eagerly, the whole string
    pipeline = patchkit.last_pipeline()

    async def body(frontend: Frontend) -> tuple[list[str], Any]:
        deltas: list[str] = []
        result = await frontend.query({"text": "a b c d"}, on_delta=deltas.append)
        return deltas, result.output

    deltas, output = serve(pipeline, body)
    assert deltas == ["a", " b", " c", " d"]
    assert output == "a b c d"


def test_a_field_of_a_dict_output_streams() -> None:
    teller = Teller()

    def told(text: str) -> patchkit.Pipeline:
        with patchkit.capture() as pipeline:
            answer = teller.tell(text)
            result = {"answer": answer, "words": len(answer.split())}
            return result
        return pipeline

    async def body(frontend: Frontend) -> tuple[list[str], Any]:
        deltas: list[str] = []
        result = await frontend.query({"text": "a b"}, on_delta=deltas.append)
        return deltas, result.output

    assert told("x") == {"answer": "x", "words": 1}
    assert serve(patchkit.last_pipeline(), body) == (["a", " b"], {"answer": "a b", "words": 2})


def test_a_call_that_does_not_make_the_output_does_not_stream() -> None:
    teller = Teller()

    def told(text: str) -> patchkit.Pipeline:
        with patchkit.capture() as pipeline:
            words = teller.tell(text)
            return len(words.split())
        return pipeline

    async def body(frontend: Frontend) -> tuple[list[str], Any]:
        deltas: list[str] = []
        result = await frontend.query({"text": "a b c"}, on_delta=deltas.append)
        return deltas, result.output

    assert told("x y") == 2
    assert serve(patchkit.last_pipeline(), body) == ([], 3)


def test_a_cancelled_request_stops_its_streaming_call_at_the_worker() -> None:

    async def body(frontend: Frontend) -> tuple[dict[str, Any], dict[str, Any]]:
        first = asyncio.Event()
        task = asyncio.ensure_future(frontend.query({"text": " ".join(["w"] * 100)}, on_delta=lambda _: first.set()))
        await asyncio.wait_for(first.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(1.0)  # the worker stops it at its next chunk
        report = next(iter((await frontend.replica_stats()).values()))
        return report, frontend.stats()["requests"]

    report, requests = serve(slow_telling(), body)
    assert report["cancelled"] == 1
    assert report["component_stats"] == {"closed_early": 1, "finished": 0}
    assert requests["cancelled"] == 1 and "error" not in requests


def test_calls_sharing_a_prefix_go_to_the_replica_that_holds_it() -> None:
    keyed = Keyed()

    def located(group: str, n: int) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return keyed.where(group, n)
        return pipeline

    async def body(frontend: Frontend) -> dict[str, set[int]]:
        seen: dict[str, set[int]] = {}
        for round_ in range(3):
            results = await asyncio.gather(*(frontend.query({"group": g, "n": round_}) for g in "abcdef"))
            for g, result in zip("abcdef", results):
                seen.setdefault(g, set()).add(result.output)
        return seen

    seen = serve(located("g", 0), body, replicas={"keyed": 2})
    assert all(len(pids) == 1 for pids in seen.values()), seen  # each group stayed on one replica
    assert len(set().union(*seen.values())) == 2  # and the groups were spread over both


def test_an_aquery_cancelled_by_its_caller_cancels_the_request_on_the_server() -> None:

    async def give_up(endpoint: patchkit.Endpoint) -> None:
        task = asyncio.ensure_future(endpoint.aquery(text=" ".join(["w"] * 100)))
        await asyncio.sleep(2.0)  # it is running at the worker by now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with patchkit.deploy(slow_telling()) as endpoint:
        asyncio.run(give_up(endpoint))
        deadline = time.monotonic() + 20
        while endpoint.stats()["requests"].get("cancelled", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(0.5)  # the worker stops the call at its next chunk
        stats = endpoint.stats()
    assert stats["requests"]["cancelled"] == 1
    [report] = stats["replica_reports"].values()
    assert report["cancelled"] == 1 and report["component_stats"] == {"closed_early": 1, "finished": 0}


class Counted(Component):
    """Holds each call `pause_s`, counting the most calls its replica ran at once."""

    def __init__(self, pause_s: float) -> None:
        self.pause_s = pause_s

    def setup(self) -> None:
        self.lock = threading.Lock()
        self.running = self.peak = 0

    @make(max_concurrency=8)
    def hold(self, name: str) -> str:
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        time.sleep(self.pause_s)
        with self.lock:
            self.running -= 1
        return name

    def stats(self) -> dict[str, Any]:
        return {"peak": self.peak}


def held(counted: Counted, name: str) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        return counted.hold(name)  # type: ignore[no-any-return]
    return pipeline


async def peak_of_six(frontend: Frontend) -> int:
    await asyncio.gather(*(frontend.query({"name": str(i)}) for i in range(6)))
    report = next(iter((await frontend.replica_stats()).values()))
    return int(report["component_stats"]["peak"])


def test_the_batch_size_of_a_concurrent_method_bounds_its_calls_at_once() -> None:
    assert serve(held(Counted(pause_s=0.2), "x"), peak_of_six, batch_size={"counted.hold": 2}) == 2


def test_a_concurrent_method_runs_up_to_its_max_concurrency_by_default() -> None:
    assert serve(held(Counted(pause_s=0.2), "x"), peak_of_six) == 6  # all six at once: its batch size is 8
