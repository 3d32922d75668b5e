"""How a replica runs one batch, for plain `def` and `async def` methods alike, on every path a batch takes
here: on a thread (`run_calls`), on the component loop (`run_calls_async`), in a worker's service and in the
inprocess backend's channel. A batch method that fails is run again one call at a time, so that one bad
input fails only its own call; a stream's error fails only its call; a call whose request ends stops, its
generator closed, while the calls beside it run to their end."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

import pytest

from patchkit import Component, make
from patchkit.core.event_loop import component_loop
from patchkit.errors import Cancelled, DeadlineExceeded
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.execute import COMPONENT, FRONTEND, Failure, Outcome, StopFlag, run_calls, run_calls_async
from patchkit.orchestrator.inprocess import DirectChannel
from patchkit.orchestrator.rpc import WireCall
from patchkit.orchestrator.service import WorkerService

Call = tuple[tuple[Any, ...], dict[str, Any]]
OnChunk = Callable[[int, str], None]
ENTRIES = ["thread", "loop", "worker", "inprocess"]
# Every entry with every kind of method, but the component loop's, which runs `async def` methods only.
PATHS = [(entry, kind) for entry in ENTRIES for kind in ("def", "async def") if (entry, kind) != ("loop", "def")]


class Checker(Component):
    """A batch method that refuses a whole batch holding a bad text; records every batch it is given."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    @make(batch=True)
    def check(self, texts: list[str]) -> list[str]:
        return self._check(texts)

    @make(batch=True)
    async def acheck(self, texts: list[str]) -> list[str]:
        await asyncio.sleep(0)
        return self._check(texts)

    @make(batch=True)
    async def linger(self, texts: list[str]) -> list[str]:
        self.batches.append(list(texts))
        await asyncio.sleep(30)
        return texts

    def _check(self, texts: list[str]) -> list[str]:
        self.batches.append(list(texts))
        bad = [text for text in texts if "bad" in text]
        if bad:
            raise ValueError(f"cannot check {bad[0]!r}")
        return [text.upper() for text in texts]


class Talker(Component):
    """Streams a text word by word; "boom" raises mid-stream, "forever" never ends. Records the generators closed."""

    def __init__(self) -> None:
        self.closed: list[str] = []

    @make(stream=True)
    def talk(self, text: str) -> Iterator[str]:
        try:
            for word in _words(text):
                time.sleep(0.001)
                yield word
        finally:
            self.closed.append(text)

    @make(stream=True)
    async def atalk(self, text: str) -> AsyncIterator[str]:
        try:
            for word in _words(text):
                await asyncio.sleep(0.001)
                yield word
        finally:
            self.closed.append(text)


def _words(text: str) -> Iterator[str]:
    words = text.split() if text != "forever" else ["on"] * 5000  # 5000: far past any stop, short of a hang
    for word in words:
        if word == "boom":
            raise ValueError(f"boom in {text!r}")
        yield word + " "


def run(entry: str, component: Component, method: str, calls: Sequence[Call],
        stop_at: tuple[int, int] | None = None) -> tuple[list[Outcome], dict[int, list[str]]]:
    """Run `calls` as one batch through `entry`; with `stop_at=(i, n)`, call i's request ends once it has
    handed on n chunks. Returns the outcomes and the chunks each call handed on."""
    chunks: dict[int, list[str]] = {i: [] for i in range(len(calls))}
    ends: list[Callable[[], object]] = []  # ends[i]() ends call i's request, as its entry learns of it

    def on_chunk(index: int, text: str) -> None:
        chunks[index].append(text)
        if stop_at == (index, len(chunks[index])):
            ends[index]()

    return RUNNERS[entry](component, method, calls, on_chunk, ends), chunks


def _on_thread(component: Component, method: str, calls: Sequence[Call], on_chunk: OnChunk,
               ends: list[Callable[[], object]]) -> list[Outcome]:
    stops = [StopFlag() for _ in calls]
    ends.extend(stop.set for stop in stops)
    return run_calls(component, method, calls, on_chunk, stops)


def _on_loop(component: Component, method: str, calls: Sequence[Call], on_chunk: OnChunk,
             ends: list[Callable[[], object]]) -> list[Outcome]:
    stops = [StopFlag() for _ in calls]
    ends.extend(stop.set for stop in stops)
    return component_loop().run(run_calls_async(component, method, calls, on_chunk, stops, [None] * len(calls)), "test")


def _in_worker(component: Component, method: str, calls: Sequence[Call], on_chunk: OnChunk,
               ends: list[Callable[[], object]]) -> list[Outcome]:
    wired = [WireCall(call, streamed=True) for call in calls]
    ends.extend(call.cancelled.set for call in wired)

    def read(index: int, text: str) -> None:  # the front-end reads each chunk at once and says so
        on_chunk(index, text)
        window = wired[index].window
        if window is not None:
            window.give()

    service = WorkerService(component, "component", "secret", dict)
    try:
        return service.run(method, wired, time.monotonic(), read)
    finally:
        service.pool.shutdown()


def _in_process(component: Component, method: str, calls: Sequence[Call], on_chunk: OnChunk,
                ends: list[Callable[[], object]]) -> list[Outcome]:
    async def go() -> list[Outcome]:
        loop = asyncio.get_running_loop()
        envelopes = [CallEnvelope(args, kwargs, on_chunk=lambda text, i=i: on_chunk(i, text), ended=loop.create_future())
                     for i, (args, kwargs) in enumerate(calls)]
        ends.extend(envelope.ended.cancel for envelope in envelopes if envelope.ended is not None)
        return await DirectChannel(component, "component", [asyncio.Lock()]).run_batch(method, envelopes)

    return asyncio.run(go())


RUNNERS = {"thread": _on_thread, "loop": _on_loop, "worker": _in_worker, "inprocess": _in_process}


def _failure(outcome: Outcome) -> Failure:
    ok, failure = outcome
    assert not ok and isinstance(failure, Failure), outcome
    return failure


def _only_the_middle_one_failed(outcomes: list[Outcome], first: str, last: str, message: str) -> None:
    """The first and last of three calls answered; the middle one failed with its own ValueError, alone."""
    assert outcomes[0] == (True, first) and outcomes[2] == (True, last)
    failure = _failure(outcomes[1])
    assert failure.source == COMPONENT and isinstance(failure.error, ValueError) and failure.message == message


@pytest.mark.parametrize(("entry", "kind"), PATHS)
def test_a_failing_batch_is_run_again_one_call_at_a_time_so_only_the_bad_input_fails(entry: str, kind: str) -> None:
    checker = Checker()
    texts = ["an apple", "a bad pear", "a plum"]
    outcomes, _ = run(entry, checker, "check" if kind == "def" else "acheck", [((text,), {}) for text in texts])
    _only_the_middle_one_failed(outcomes, "AN APPLE", "A PLUM", "cannot check 'a bad pear'")
    assert checker.batches == [texts, *([text] for text in texts)]  # the batch once, then each call alone


@pytest.mark.parametrize("entry", ["thread", "loop"])
def test_a_batch_that_succeeds_or_holds_one_call_runs_once(entry: str) -> None:
    checker = Checker()
    outcomes, _ = run(entry, checker, "acheck", [(("a",), {}), (("b",), {})])
    assert outcomes == [(True, "A"), (True, "B")]
    outcomes, _ = run(entry, checker, "acheck", [(("bad",), {})])
    assert _failure(outcomes[0]).message == "cannot check 'bad'"
    assert checker.batches == [["a", "b"], ["bad"]]


def test_a_batch_cancelled_at_its_deadline_is_not_run_again_call_by_call() -> None:
    checker = Checker()
    calls: list[Call] = [(("a",), {}), (("b",), {})]
    late = time.monotonic() + 0.1
    run_all = run_calls_async(checker, "linger", calls, None, [StopFlag(), StopFlag()], [late, late])
    outcomes = component_loop().run(run_all, "test")
    for outcome in outcomes:
        failure = _failure(outcome)
        assert failure.source == FRONTEND and isinstance(failure.error, DeadlineExceeded)
    assert checker.batches == [["a", "b"]]


@pytest.mark.parametrize(("entry", "kind"), PATHS)
def test_a_stream_s_error_fails_only_its_own_call(entry: str, kind: str) -> None:
    talker = Talker()
    texts = ["one two", "three boom four", "five six seven"]
    outcomes, chunks = run(entry, talker, "talk" if kind == "def" else "atalk", [((text,), {}) for text in texts])
    _only_the_middle_one_failed(outcomes, "one two ", "five six seven ", "boom in 'three boom four'")
    assert chunks == {0: ["one ", "two "], 1: ["three "], 2: ["five ", "six ", "seven "]}
    assert sorted(talker.closed) == sorted(texts)  # every generator closed, the failed one included


@pytest.mark.parametrize(("entry", "kind"), PATHS)
def test_a_stream_whose_request_ends_stops_as_cancelled_and_its_neighbours_run_on(entry: str, kind: str) -> None:
    talker = Talker()
    outcomes, chunks = run(entry, talker, "talk" if kind == "def" else "atalk",
                           [(("forever",), {}), (("the end",), {})], stop_at=(0, 3))
    failure = _failure(outcomes[0])
    assert failure.source == FRONTEND and isinstance(failure.error, Cancelled)
    assert 3 <= len(chunks[0]) < 5000  # stopped soon after its request ended, never run to its end
    assert outcomes[1] == (True, "the end ")
    assert sorted(talker.closed) == ["forever", "the end"]  # the stopped call's generator closed too
