"""`async def` components: per-item and batch methods, async generators streaming, async setup, called
eagerly (inside a running event loop too) and deployed on worker processes and in process; calls of a
replica awaiting together on one loop, cancelled where they await when their request ends, and a
step that blocks the loop named in a warning."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from serving import run_frontend

import patchkit
from patchkit import Component, make
from patchkit.core.event_loop import component_loop, run_inline
from patchkit.core.make import DEFAULT_ASYNC_CONCURRENCY
from patchkit.errors import Cancelled, DeadlineExceeded, MakeError
from patchkit.orchestrator.execute import Outcome, StopFlag, run_calls_async
from patchkit.serving.frontend import Frontend

BACKENDS = [pytest.param("local", marks=pytest.mark.slow), "inprocess"]


class Base(Component):
    """An async setup that a subclass's own async setup awaits."""

    async def setup(self) -> None:
        await asyncio.sleep(0.01)
        self.offset = 100


class Waiter(Base):
    """Awaits `pause_s` per call, as a client awaiting a remote API; counts what its replica ran at once and where."""

    def __init__(self, pause_s: float = 0.05) -> None:
        self.pause_s = pause_s

    async def setup(self) -> None:
        await super().setup()
        self.loop = asyncio.get_running_loop()  # what setup() makes on the loop, the calls use on the same loop
        self.gate = asyncio.Semaphore(1000)
        self.running = self.most = self.cancelled = self.batches = 0
        self.sizes: list[int] = []
        self.threads: set[str] = set()

    @make(max_concurrency=64)
    async def wait(self, x: int) -> int:
        assert asyncio.get_running_loop() is self.loop
        self.threads.add(threading.current_thread().name)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            async with self.gate:
                await asyncio.sleep(self.pause_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        return x + self.offset

    @make(batch=True, max_batch_size=16)
    async def double(self, xs: list[int], ys: list[int]) -> list[int]:
        self.batches += 1
        self.sizes.append(len(xs))
        await asyncio.sleep(self.pause_s)
        return [2 * x + y for x, y in zip(xs, ys)]

    @make(stream=True, max_concurrency=8)
    async def tell(self, text: str) -> AsyncIterator[str]:
        for i, word in enumerate(text.split()):
            await asyncio.sleep(0.01)
            yield word if i == 0 else " " + word

    def stats(self) -> dict[str, Any]:
        return {"most": self.most, "cancelled": self.cancelled, "batches": self.batches, "calls_batched": sum(self.sizes),
                "largest_batch": max(self.sizes, default=0), "threads": len(self.threads)}


class Sleeper(Component):
    """Awaits `seconds` and counts the calls cancelled where they awaited; with `marks`, it also leaves a file
    there for each, which outlives the replica (one that served only ended requests is replaced)."""

    def __init__(self, marks: str | None = None) -> None:
        self.marks = marks

    def setup(self) -> None:
        self.started = self.cancelled = 0

    @make(max_concurrency=4)
    async def nap(self, seconds: float) -> str:
        self.started += 1
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            if self.marks is not None:
                Path(self.marks, f"cancelled-{self.cancelled}").touch()
            raise
        return "woke"

    def stats(self) -> dict[str, Any]:
        return {"started": self.started, "cancelled": self.cancelled}


class Blocker(Component):
    @make
    async def stall(self, seconds: float) -> str:
        time.sleep(seconds)  # blocks the loop: the mistake the warning is for
        await asyncio.sleep(0)
        return "stalled"


def serve(pipeline: patchkit.Pipeline, body: Callable[[Frontend], Awaitable[Any]], backend: str, **options: Any) -> Any:
    return run_frontend(pipeline, body, backend=backend, **options)


async def component_stats(frontend: Frontend) -> dict[str, Any]:
    """The component stats of the pipeline's only replica."""
    [report] = (await frontend.replica_stats()).values()
    stats: dict[str, Any] = report["component_stats"]
    return stats


def waiting(waiter: Waiter) -> patchkit.Pipeline:
    x = 1
    with patchkit.capture() as pipeline:
        y = waiter.wait(x)
        z = waiter.double(y, x)
        return waiter.tell(f"{y} and {z}")  # type: ignore[no-any-return]
    return pipeline


def test_an_eager_call_runs_each_kind_of_async_method_and_its_async_setup() -> None:
    waiter = Waiter(pause_s=0.01)
    assert waiter.wait(1) == 101  # the parent's async setup ran inside the subclass's
    assert waiter.double(3, 1) == 7
    assert waiter.tell("a b c") == "a b c"
    assert list(Waiter.tell.chunks(waiter, ("a b c",), {})) == ["a", " b", " c"]


def test_eager_calls_inside_a_running_event_loop_work_as_a_notebook_cell_makes_them() -> None:
    waiter = Waiter(pause_s=0.01)

    async def cell() -> tuple[Any, ...]:  # a Jupyter cell's code runs while the kernel's loop runs
        with patchkit.capture() as pipeline:
            y = waiter.wait(2)
            z = waiter.double(y, 2)
            told = waiter.tell(f"{y} {z}")
        return y, z, told, pipeline(), waiter.wait(5)

    y, z, told, again, direct = asyncio.run(cell())
    assert (y, z, told, direct) == (102, 206, "102 206", 105)
    assert again == "102 206"  # pipeline(...) eagerly, in the loop too


@pytest.mark.parametrize("backend", BACKENDS)
def test_deployed_async_methods_answer_as_eagerly_and_stream(backend: str) -> None:
    waiter = Waiter()
    assert waiting(waiter) == "101 and 203"

    async def body(frontend: Frontend) -> tuple[list[Any], list[str], dict[str, Any]]:
        results = await asyncio.gather(*(frontend.query({"x": x}) for x in range(24)))
        deltas: list[str] = []
        streamed = await frontend.query({"x": 7}, on_delta=deltas.append)
        assert streamed.output == "".join(deltas)
        return [r.output for r in results], deltas, await component_stats(frontend)

    outputs, deltas, stats = serve(patchkit.last_pipeline(), body, backend)
    assert outputs == [f"{x + 100} and {2 * (x + 100) + x}" for x in range(24)]
    assert deltas == ["107", " and", " 221"]  # the async generator's chunks, each sent as it was made
    captured = 1 if backend == "inprocess" else 0  # inprocess serves the very object the capture's run called
    assert stats["calls_batched"] == 25 + captured  # every call of the batch method, in batches: one await each
    if backend == "local":
        assert stats["largest_batch"] > 1 and stats["batches"] < 25


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_class_that_travels_by_value_keeps_its_async_setup(backend: str) -> None:
    class Greeter(Component):  # defined in a function, as in a notebook cell: it travels by value
        async def setup(self) -> None:
            await asyncio.sleep(0)
            self.greeting = "hello"

        @make(max_concurrency=8)
        async def greet(self, name: str) -> str:
            await asyncio.sleep(0.01)
            return f"{self.greeting} {name}"

    greeter = Greeter()

    def greeted(name: str) -> patchkit.Pipeline:
        with patchkit.capture() as pipeline:
            return greeter.greet(name)  # type: ignore[no-any-return]
        return pipeline

    assert greeted("eager") == "hello eager"

    async def body(frontend: Frontend) -> list[Any]:
        return [r.output for r in await asyncio.gather(*(frontend.query({"name": n}) for n in "abc"))]

    assert serve(patchkit.last_pipeline(), body, backend) == ["hello a", "hello b", "hello c"]


def test_a_worker_runs_an_async_method_s_calls_together_on_one_thread() -> None:
    waiter = Waiter(pause_s=0.5)

    def waited(x: int) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return waiter.wait(x)  # type: ignore[no-any-return]
        return pipeline

    async def body(frontend: Frontend) -> tuple[list[Any], dict[str, Any]]:
        results = await asyncio.gather(*(frontend.query({"x": x}) for x in range(48)))
        return [r.output for r in results], await component_stats(frontend)

    outputs, stats = serve(waited(0), body, "local")
    assert outputs == [x + 100 for x in range(48)]
    assert stats["most"] == 48  # all at once: each awaiting on the loop...
    assert stats["threads"] == 1  # ...of one thread, not a thread each


def napping(sleeper: Sleeper) -> patchkit.Pipeline:
    seconds = 0.0
    with patchkit.capture(run=False) as pipeline:
        return sleeper.nap(seconds)  # type: ignore[no-any-return]
    return pipeline


async def until(frontend: Frontend, key: str, count: int) -> dict[str, Any]:
    """The replica's component stats once `key` reaches `count`, or after 20 s."""
    deadline = time.monotonic() + 20
    while (stats := await component_stats(frontend))[key] < count and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return stats


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_client_that_goes_away_cancels_its_awaiting_call(backend: str) -> None:
    async def body(frontend: Frontend) -> tuple[dict[str, Any], str]:
        task = asyncio.ensure_future(frontend.query({"seconds": 120.0}))
        await until(frontend, "started", 1)
        task.cancel()  # its client went away
        with pytest.raises(asyncio.CancelledError):
            await task
        return await until(frontend, "cancelled", 1), (await frontend.query({"seconds": 0.01})).output

    stats, after = serve(napping(Sleeper()), body, backend)
    assert stats["cancelled"] == 1  # cancelled where it awaited, long before its two minutes
    assert after == "woke"  # and the replica serves on


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_request_past_its_deadline_cancels_its_awaiting_call(backend: str, tmp_path: Path) -> None:
    async def body(frontend: Frontend) -> list[str]:
        with pytest.raises(DeadlineExceeded):
            await frontend.query({"seconds": 120.0})
        deadline = time.monotonic() + 20
        while not any(tmp_path.iterdir()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return sorted(p.name for p in tmp_path.iterdir())

    assert serve(napping(Sleeper(str(tmp_path))), body, backend, request_timeout_s=1.0) == ["cancelled-1"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_step_that_blocks_the_loop_is_a_warning_naming_the_method(
    backend: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    blocker = Blocker()
    with caplog.at_level(logging.WARNING, logger="patchkit"):
        assert blocker.stall(0.0) == "stalled"
        assert "held the event loop" not in caplog.text
        assert blocker.stall(0.15) == "stalled"
    assert "Blocker.stall held the event loop for 0.1" in caplog.text

    def stalled(seconds: float) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return blocker.stall(seconds)  # type: ignore[no-any-return]
        return pipeline

    async def body(frontend: Frontend) -> Any:
        return (await frontend.query({"seconds": 0.15})).output

    caplog.clear()
    capfd.readouterr()
    with caplog.at_level(logging.WARNING, logger="patchkit"):
        assert serve(stalled(0.0), body, backend) == "stalled"
    logged = caplog.text if backend == "inprocess" else capfd.readouterr().err  # a worker logs to its stderr
    assert "Blocker.stall held the event loop for" in logged


def test_make_takes_async_methods_and_names_what_it_cannot_serve() -> None:
    with pytest.raises(MakeError, match=r"stream=True\) on .*Told.tell: it must be a generator function"):

        class Told(Component):
            @make(stream=True)
            async def tell(self, text: str) -> str:
                return text

    with pytest.raises(MakeError, match="Unstreamed.tell: a method yielding text chunks takes @make\\(stream=True\\)"):

        class Unstreamed(Component):
            @make
            async def tell(self, text: str) -> AsyncIterator[str]:
                yield text

    with pytest.raises(MakeError, match="per-item method, not batch=True"):

        class Batched(Component):
            @make(batch=True, stream=True)
            async def tell(self, texts: list[str]) -> AsyncIterator[str]:
                yield texts[0]


class Careful(Component):
    """Per call: waits `seconds`; one that is told to `swallow` its cancellation answers "late" instead."""

    @make(max_concurrency=8)
    async def wait(self, seconds: float, swallow: bool = False) -> str:
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            if not swallow:
                raise
            await asyncio.sleep(0.01)  # the task is not left cancelled: it can await again
            return "late"
        return "done"


def test_a_stopped_call_of_a_batch_is_cancelled_alone_and_may_answer_instead() -> None:
    careful = Careful()
    calls = [((5.0,), {}), ((0.05,), {}), ((5.0,), {"swallow": True})]
    stops = [StopFlag() for _ in calls]

    async def run() -> list[Outcome]:
        return await run_calls_async(careful, "wait", calls, None, stops, [None, None, None])

    running = component_loop().submit(run())
    time.sleep(0.2)
    stops[0].set()  # its request ended: set from another thread, as a worker's stream does
    stops[2].set()
    outcomes = running.result(timeout=10)
    assert outcomes[0][0] is False and isinstance(outcomes[0][1].error, Cancelled)
    assert outcomes[1] == (True, "done")  # the call beside it ran to its end
    assert outcomes[2] == (True, "late")


def test_a_call_past_its_deadline_is_cancelled_with_deadline_exceeded() -> None:
    async def run() -> list[Outcome]:
        return await run_calls_async(Careful(), "wait", [((5.0,), {})], None, [StopFlag()], [time.monotonic() + 0.1])

    [(ok, failure)] = component_loop().run(run(), "test")
    assert not ok and isinstance(failure.error, DeadlineExceeded)


class Caller(Component):
    """Awaits, as a client of a remote API, until `together` of its calls are in flight (or `patience_s` passes);
    records the most of its calls in flight at once. Holding each call until the others arrive makes the count
    depend on the cap alone, not on how fast a loaded machine delivers the requests."""

    def __init__(self, together: int, patience_s: float = 30.0) -> None:
        self.together = together
        self.patience_s = patience_s

    def setup(self) -> None:
        self.running = self.most = 0
        self.arrived = asyncio.Event()

    @make(max_concurrency=512)
    async def ask(self, x: int) -> int:
        return await self._await(x)

    @make
    async def plain(self, x: int) -> int:  # no max_concurrency: DEFAULT_ASYNC_CONCURRENCY
        return await self._await(x)

    async def _await(self, x: int) -> int:
        self.running += 1
        self.most = max(self.most, self.running)
        if self.running >= self.together:
            self.arrived.set()
        try:
            await asyncio.wait_for(self.arrived.wait(), self.patience_s)
            await asyncio.sleep(0.2)  # a call admitted past the cap would be counted meanwhile
        finally:
            self.running -= 1
        return 2 * x

    def stats(self) -> dict[str, Any]:
        return {"most": self.most}


def asking(caller: Caller) -> patchkit.Pipeline:
    x = 0
    with patchkit.capture(run=False) as pipeline:
        return caller.ask(x)  # type: ignore[no-any-return]
    return pipeline


def asking_plainly(caller: Caller) -> patchkit.Pipeline:
    x = 0
    with patchkit.capture(run=False) as pipeline:
        return caller.plain(x)  # type: ignore[no-any-return]
    return pipeline


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("plain", [False, True], ids=["max_concurrency", "default"])
def test_an_async_method_s_calls_await_together_on_every_backend(backend: str, plain: bool) -> None:
    async def body(frontend: Frontend) -> tuple[list[Any], dict[str, Any]]:
        results = await asyncio.gather(*(frontend.query({"x": x}) for x in range(50)))
        return [r.output for r in results], await component_stats(frontend)

    caller = Caller(together=DEFAULT_ASYNC_CONCURRENCY if plain else 50)
    outputs, stats = serve((asking_plainly if plain else asking)(caller), body, backend, slo_ms=120_000)
    assert outputs == [2 * x for x in range(50)]
    # All 50 at once where the method allows 512; DEFAULT_ASYNC_CONCURRENCY (32) of them without max_concurrency.
    assert stats["most"] == (DEFAULT_ASYNC_CONCURRENCY if plain else 50)


class Fetcher(Component):
    """A per-item async method without max_concurrency, given batches by deploy(batch_size=...)."""

    def setup(self) -> None:
        self.running = self.most = 0

    @make(max_batch_size=8)
    async def fetch(self, x: int) -> int:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(0.2)
        finally:
            self.running -= 1
        return x + 1


def test_a_per_item_async_method_s_batch_awaits_together() -> None:
    fetcher = Fetcher()
    fetcher.setup()
    calls = [((x,), {}) for x in range(8)]

    async def run() -> list[Outcome]:
        return await run_calls_async(fetcher, "fetch", calls, None, [StopFlag() for _ in calls], [None] * 8)

    assert component_loop().run(run(), "test") == [(True, x + 1) for x in range(8)]
    assert fetcher.most == 8  # the batch's calls awaited at once, not one after another
    fetcher.most = 0
    assert Fetcher.fetch.run_batch(fetcher, calls) == [x + 1 for x in range(8)]  # its eager batch too
    assert fetcher.most == 8


def test_a_plain_method_runs_through_the_async_core_in_the_calling_thread_and_no_loop() -> None:
    """A plain method's batch and stream run through the core an `async def` method's run on, here: in the caller's
    thread, with no event loop running there, and its generator closed when its reader stops."""

    class Plain(Component):
        def __init__(self) -> None:
            self.seen: list[tuple[int, bool]] = []
            self.closed = False

        def _note(self) -> None:
            try:
                asyncio.get_running_loop()
                running = True
            except RuntimeError:
                running = False
            self.seen.append((threading.get_ident(), running))

        @make
        def double(self, x: int) -> int:
            self._note()
            return 2 * x

        @make(stream=True)
        def count(self, n: int) -> Any:
            self._note()
            try:
                for i in range(n):
                    yield str(i)
            finally:
                self.closed = True

    plain = Plain()
    assert Plain.double.run_batch(plain, [((1,), {}), ((2,), {})]) == [2, 4]
    assert plain.count(3) == "012"
    chunks = Plain.count.chunks(plain, (5,), {})
    assert next(chunks) == "0"
    plain.closed = False
    chunks.close()
    assert plain.closed
    assert plain.seen == [(threading.get_ident(), False)] * 4


def test_run_inline_refuses_a_coroutine_that_waits() -> None:
    async def waits() -> None:
        await asyncio.sleep(0)

    with pytest.raises(RuntimeError, match="waited"):
        run_inline(waits())
