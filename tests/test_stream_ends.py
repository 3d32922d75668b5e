"""A stream ends however its generator ends, on every backend and eagerly, and paces its generator.

A generator component (`def` or `async def`) may return, raise, raise a `CancelledError` of its own (it
awaited a future that was cancelled elsewhere) or a `GeneratorExit`, or lose its client halfway: a
deployed `Endpoint.stream()` ends each time, with the component's error where there is one, and the
generator's `finally` runs. Each consumer runs in a thread joined with a timeout, so that a stream that
never ends fails the test instead of blocking it. A reader that does not read holds its generator back:
at most a window of chunks (`STREAM_BUFFER`) wait between them, never the whole stream.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from serving import run_frontend

import patchkit
from patchkit import Component, make
from patchkit.core.event_loop import STREAM_BUFFER
from patchkit.errors import ComponentError
from patchkit.server.events import pump
from patchkit.serving.frontend import Frontend

BACKENDS = [pytest.param("inprocess", id="inprocess"), pytest.param("local", id="local", marks=pytest.mark.slow)]
ENDINGS = ["returns", "raises", "cancelled", "generator-exit"]
HANG_S = 60.0  # far longer than any of these streams takes to end; a stream still open then hangs


def ending(how: str) -> None:
    """Raise as a generator ends `how` (return: nothing)."""
    if how == "raises":
        raise ValueError("the index is gone")
    if how == "cancelled":
        raise asyncio.CancelledError("a future it waited for was cancelled elsewhere")
    if how == "generator-exit":
        raise GeneratorExit("closed from inside")


class Teller(Component):
    """Tells two words, then ends as `how` says; with `marks`, leaves `finally-<prompt>` there once it ends."""

    def __init__(self, marks: str | None = None) -> None:
        self.marks = marks

    @make(stream=True)
    def tell(self, prompt: str, how: str) -> Iterator[str]:
        try:
            yield "one"
            yield " two"
            if how == "forever":
                while True:
                    time.sleep(0.01)
                    yield " more"
            ending(how)
        finally:
            self._mark(prompt)

    @make(stream=True)
    async def atell(self, prompt: str, how: str) -> AsyncIterator[str]:
        try:
            yield "one"
            await asyncio.sleep(0.01)
            yield " two"
            if how == "forever":
                while True:
                    await asyncio.sleep(0.01)
                    yield " more"
            if how == "cancelled":  # as a client's future cancelled by another task, awaited here
                cancelled = asyncio.get_running_loop().create_future()
                cancelled.cancel()
                await cancelled
            ending(how)
        finally:
            self._mark(prompt)

    def _mark(self, prompt: str) -> None:
        if self.marks is not None:
            Path(self.marks, f"finally-{prompt}").touch()


def told(teller: Teller, asynchronous: bool) -> patchkit.Pipeline:
    return told_async(teller) if asynchronous else told_sync(teller)


def told_sync(teller: Teller) -> patchkit.Pipeline:
    prompt, how = "p", "returns"
    with patchkit.capture(run=False) as pipeline:
        return teller.tell(prompt, how)  # type: ignore[no-any-return]
    return pipeline


def told_async(teller: Teller) -> patchkit.Pipeline:
    prompt, how = "p", "returns"
    with patchkit.capture(run=False) as pipeline:
        return teller.atell(prompt, how)  # type: ignore[no-any-return]
    return pipeline


def read(stream: Any, most: int | None = None) -> tuple[list[str], BaseException | None]:
    """The chunks of `stream` (up to `most`, then it is closed) and what it raised, read in a thread that must end
    within HANG_S."""
    chunks: list[str] = []
    raised: list[BaseException | None] = [None]

    def consume() -> None:
        iterator = iter(stream)
        try:
            for chunk in iterator:
                chunks.append(chunk)
                if most is not None and len(chunks) == most:
                    break
        except BaseException as exc:  # noqa: BLE001 - what the stream raised is the result
            raised[0] = exc
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()

    reader = threading.Thread(target=consume, daemon=True)
    reader.start()
    reader.join(HANG_S)
    assert not reader.is_alive(), f"the stream never ended: it gave {chunks} and then nothing"
    return chunks, raised[0]


def marked(marks: Path, prompt: str) -> bool:
    """Whether `finally-<prompt>` appears in `marks` within 20 s."""
    deadline = time.monotonic() + 20
    while not (marks / f"finally-{prompt}").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return (marks / f"finally-{prompt}").exists()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["def", "async-def"])
@pytest.mark.parametrize("how", ENDINGS)
def test_an_eager_call_ends_as_its_generator_does(how: str, asynchronous: bool, tmp_path: Path) -> None:
    teller = Teller(str(tmp_path))
    method = teller.atell if asynchronous else teller.tell
    if how == "returns":
        assert method("eager", how) == "one two"
    else:
        with pytest.raises(BaseException) as caught:
            method("eager", how)
        assert isinstance(caught.value, (ValueError, asyncio.CancelledError, GeneratorExit, ComponentError)) or \
            type(caught.value).__name__ == "CancelledError"
    assert marked(tmp_path, "eager")
    chunks, raised = read(type(teller).atell.chunks(teller, ("chunks", how), {}) if asynchronous else
                          type(teller).tell.chunks(teller, ("chunks", how), {}))
    assert chunks == ["one", " two"]
    assert (raised is None) == (how == "returns")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["def", "async-def"])
@pytest.mark.parametrize("how", ENDINGS)
def test_a_deployed_stream_ends_with_the_generator_s_error(backend: str, how: str, asynchronous: bool,
                                                           tmp_path: Path) -> None:
    with patchkit.deploy(told(Teller(str(tmp_path)), asynchronous), backend=backend, slo_ms=120_000) as endpoint:
        chunks, raised = read(endpoint.stream(prompt="q", how=how))
        after = endpoint.query(prompt="again", how="returns")  # the replica serves on
    assert chunks[:2] == ["one", " two"]
    if how == "returns":
        assert raised is None and chunks == ["one", " two"]
    else:
        assert isinstance(raised, ComponentError), raised
        expected = {"raises": "ValueError", "cancelled": "CancelledError", "generator-exit": "GeneratorExit"}[how]
        assert expected in str(raised)
    assert after == "one two"
    assert marked(tmp_path, "q")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["def", "async-def"])
def test_a_client_that_leaves_early_ends_the_generator(backend: str, asynchronous: bool, tmp_path: Path) -> None:
    with patchkit.deploy(told(Teller(str(tmp_path)), asynchronous), backend=backend, slo_ms=120_000) as endpoint:
        chunks, raised = read(endpoint.stream(prompt="left", how="forever"), most=3)
        assert raised is None and chunks == ["one", " two", " more"]
        assert marked(tmp_path, "left")  # its finally ran: the generator was closed, not left to run forever


class Counter(Component):
    """Streams `count` numbered chunks as fast as it is asked for them, counting those it made."""

    def setup(self) -> None:
        self.made = 0

    @make(stream=True)
    def count(self, count: int) -> Iterator[str]:
        for i in range(count):
            self.made += 1
            yield f"{i} "

    @make(stream=True)
    async def acount(self, count: int) -> AsyncIterator[str]:
        for i in range(count):
            self.made += 1
            await asyncio.sleep(0)
            yield f"{i} "

    def stats(self) -> dict[str, Any]:
        return {"made": self.made}


def counting(counter: Counter, asynchronous: bool) -> patchkit.Pipeline:
    return counting_async(counter) if asynchronous else counting_sync(counter)


def counting_sync(counter: Counter) -> patchkit.Pipeline:
    count = 3
    with patchkit.capture(run=False) as pipeline:
        return counter.count(count)  # type: ignore[no-any-return]
    return pipeline


def counting_async(counter: Counter) -> patchkit.Pipeline:
    count = 3
    with patchkit.capture(run=False) as pipeline:
        return counter.acount(count)  # type: ignore[no-any-return]
    return pipeline


CHUNKS = 5000  # what a generator that never waits for its reader makes long before the reader is back


async def settled(made: Callable[[], Awaitable[int]]) -> int:
    """How far the generator got once it stopped going further (or made every chunk)."""
    last, still_since = -1, time.monotonic()
    while time.monotonic() - still_since < 1.0:
        now = await made()
        if now >= CHUNKS:
            return now
        if now != last:
            last, still_since = now, time.monotonic()
        await asyncio.sleep(0.05)
    return last


@pytest.mark.parametrize("asynchronous", [False, True], ids=["def", "async-def"])
def test_an_eager_stream_s_generator_waits_for_its_reader(asynchronous: bool) -> None:
    counter = Counter()
    counter.setup()
    method = Counter.acount if asynchronous else Counter.count
    chunks = method.chunks(counter, (CHUNKS,), {})
    assert next(chunks) == "0 "

    async def made() -> int:
        return counter.made

    got = asyncio.run(settled(made))
    assert got <= 2 * STREAM_BUFFER  # bounded: the generator waits while its reader does not read
    assert "".join(chunks) == "".join(f"{i} " for i in range(1, CHUNKS))  # and goes on as it reads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["def", "async-def"])
def test_a_slow_client_holds_the_deployed_generator_back(backend: str, asynchronous: bool) -> None:
    """The composition the streaming routes run (`pump` over the front-end's query): while the client
    takes nothing, the generator makes a bounded number of chunks; then the stream goes on whole."""

    async def body(frontend: Frontend) -> tuple[int, list[str], Any]:
        gate = asyncio.Event()
        sent: list[str] = []

        async def slow_client(chunk: str) -> None:
            await gate.wait()
            sent.append(chunk)

        async def made() -> int:
            [report] = (await frontend.replica_stats()).values()
            return int(report["component_stats"]["made"])

        streaming = asyncio.ensure_future(
            pump(lambda report: frontend.query({"count": CHUNKS}, on_delta=report), slow_client))
        try:
            got = await settled(made)
        finally:
            gate.set()
        return got, sent, (await streaming).output

    got, sent, output = run_frontend(counting(Counter(), asynchronous), body, backend=backend, slo_ms=120_000)
    assert got <= 2 * STREAM_BUFFER + 2, got  # the chunks ahead of the client are bounded...
    assert "".join(sent) == output == "".join(f"{i} " for i in range(CHUNKS))  # ...and none is lost
