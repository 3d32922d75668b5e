"""The worker's side of the wire: runs batches on its component and answers health and stats.

A method runs one batch at a time, in the order its batches arrive, unless it is
`@make(max_concurrency=N)`: then each of its batches runs on a thread of its own as soon as it
arrives, up to N at once (an engine batching concurrent calls itself admits them between its
steps). An `async def` method's calls run as tasks on the process's component loop instead: a
per-item one's up to its `max_concurrency` at once (`DEFAULT_ASYNC_CONCURRENCY` where not given) with
no thread each; a `batch=True` one's one batch at a time, as any method. A `stream=True` call whose
chunks are wanted sends each chunk as it is made, at most a window of them ahead of what the
front-end reports read (its generator waits there), and stops at its next chunk when the front-end
cancels it (a task at once, wherever it awaits, as it does at its request's deadline); a call
cancelled before it starts is not run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc

from patchkit import telemetry
from patchkit.core import Call, CallHook, Component, make_methods
from patchkit.core.event_loop import ChunkWindow, component_loop, run_inline
from patchkit.errors import Cancelled, DeadlineExceeded
from patchkit.orchestrator.execute import Failure, Outcome, component_stats, run_calls_async
from patchkit.orchestrator.rpc import (
    CHECK,
    SECRET_KEY,
    SERVICE,
    Batch,
    Read,
    WireCall,
    decode_message,
    encode_chunk,
    encode_outcomes,
)

__all__ = ["WorkerService"]


class WorkerService:
    """Serves one replica's component to the front-end's streams (one per front-end connection).

    `hook`: what the component's own `@make` calls to the components it holds go through (None: they
    run here); a worker whose component holds components deployed on their own sends those calls there.
    """

    def __init__(
        self,
        component: Component,
        name: str,
        secret: str,
        describe: Callable[[], dict[str, Any]],
        hook: CallHook | None = None,
    ) -> None:
        self.component = component
        self.name = name
        self.hook = hook
        self._secret = secret
        self._describe = describe
        self._lock = threading.Lock()  # one batch at a time of the methods without max_concurrency
        self._checking = threading.Lock()  # one check_health() at a time: a hung one fails the next checks
        made = make_methods(type(component))
        self.concurrency = {name: m.max_concurrency for name, m in made.items() if m.max_concurrency}
        self.asynchronous = {name for name, m in made.items() if m.asynchronous}
        # At most N calls of an async method with max_concurrency=N run at once, whatever streams send.
        self._slots = {name: asyncio.Semaphore(n) for name, n in self.concurrency.items() if name in self.asynchronous}
        workers = sum(n for name, n in self.concurrency.items() if name not in self.asynchronous) or 1
        # Runs the batches of methods with max_concurrency, each on a thread of its own, for every stream.
        self.pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="patchkit-call")
        self._stats_lock = threading.Lock()
        self.batches = 0
        self.calls = 0
        self.skipped = 0  # calls not run: their request had run out of time before the worker reached them
        self.cancelled = 0  # calls stopped or not run: their request ended
        self.busy_s = 0.0
        self.started = time.time()

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Batches": grpc.stream_stream_rpc_method_handler(self._batches),
                "Health": grpc.unary_unary_rpc_method_handler(self._health),
                "Stats": grpc.unary_unary_rpc_method_handler(self._stats),
            },
        )

    def _authorize(self, context: grpc.ServicerContext) -> None:
        given = dict(context.invocation_metadata()).get(SECRET_KEY, "")
        if not (isinstance(given, str) and hmac.compare_digest(given.encode(), self._secret.encode())):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing deployment secret")

    def _batches(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        self._authorize(context)
        stream = _Stream(self)
        threading.Thread(target=stream.receive, args=(requests,), name="patchkit-stream", daemon=True).start()
        yield from stream.replies()

    def run(self, method: str, calls: Sequence[WireCall], arrived: float, on_chunk: Callable[[int, str], None] | None = None
            ) -> list[Outcome]:
        """Run a batch's calls: those already failed (their arguments did not unpickle), past their deadline
        (their request had run out of time by then: counted from `arrived`, the `time.monotonic()` when
        the batch arrived) or cancelled are not run.

        `on_chunk(index, text)`: where the chunks of a `stream=True` method's calls go as they are made
        (None: nowhere, each call's outcome is their concatenation); a call whose `cancelled` is set stops
        at its next chunk. The calls that run do so in execution spans continuing their traces. A method
        without `max_concurrency` waits for the replica's batch before it.
        """
        if method in self.asynchronous:  # on the component loop, while this thread waits with the replica's lock
            with self._lock:
                return component_loop().run(self.run_async(method, calls, arrived, on_chunk), method)
        if method in self.concurrency:
            return run_inline(self._run(method, calls, arrived, on_chunk, in_thread=True))
        with self._lock:
            return run_inline(self._run(method, calls, arrived, on_chunk, in_thread=True))

    async def run_async(
        self, method: str, calls: Sequence[WireCall], arrived: float, on_chunk: Callable[[int, str], None] | None = None
    ) -> list[Outcome]:
        """`run` for an `async def` method, on the component loop: its calls run as tasks there (`run_calls_async`),
        each cancelled when its `cancelled` flag is set or at its request's deadline. Awaited by a stream
        for every batch of a method with `max_concurrency` (up to that many of its calls at once), and by
        `run` for the others."""
        slots = self._slots.get(method)
        if slots is None:
            return await self._run(method, calls, arrived, on_chunk)
        async with slots:
            return await self._run(method, calls, arrived, on_chunk)

    async def _run(
        self, method: str, calls: Sequence[WireCall], arrived: float, on_chunk: Callable[[int, str], None] | None,
        in_thread: bool = False,
    ) -> list[Outcome]:
        """A batch's calls that are still wanted, run (`run_calls_async`) and counted: on the component loop,
        or with `in_thread` (a plain `def` method's, `run` runs it with `run_inline`) on this thread, as plain calls."""
        start = time.perf_counter()
        outcomes, runnable, skipped, stopped = self._sort(calls, arrived)
        if runnable:
            index = list(runnable)
            sink = (lambda k, text: on_chunk(index[k], text)) if on_chunk is not None else None
            flags = [call.cancelled for call in runnable.values()]
            deadlines = [call.deadline(arrived) for call in runnable.values()]
            arguments: list[Call] = [call.call for call in runnable.values()]  # type: ignore[misc]  # failures are out
            with telemetry.execution(self.name, method, _traces(runnable.values())):
                ran = await run_calls_async(self.component, method, arguments, sink, flags, deadlines, self.hook,
                                            _windows(runnable.values()), in_thread=in_thread)
            for i, outcome in zip(index, ran):
                outcomes[i] = outcome
            stopped += sum(flag.is_set() for flag in flags)
        return self._count(outcomes, bool(runnable), len(runnable), skipped, stopped, start)

    def _sort(
        self, calls: Sequence[WireCall], arrived: float
    ) -> tuple[list[Outcome | None], dict[int, WireCall], int, int]:
        """A batch's calls sorted: the outcomes of those not run (already failed, cancelled, past their
        deadline), the others by index, and how many were skipped (late) and stopped (cancelled)."""
        now = time.monotonic()
        outcomes: list[Outcome | None] = [None] * len(calls)
        runnable: dict[int, WireCall] = {}
        skipped = stopped = 0
        for i, call in enumerate(calls):
            deadline = call.deadline(arrived)
            if isinstance(call.call, Failure):
                outcomes[i] = (False, call.call)
            elif call.cancelled.is_set():
                outcomes[i] = (False, Failure.verdict(Cancelled("its request ended before the worker reached it")))
                stopped += 1
            elif deadline is not None and now >= deadline:
                late = DeadlineExceeded("its request ran out of time before the worker reached it: the call was not run")
                outcomes[i] = (False, Failure.verdict(late))
                skipped += 1
            else:
                runnable[i] = call
        return outcomes, runnable, skipped, stopped

    def _count(
        self, outcomes: list[Outcome | None], ran: bool, calls: int, skipped: int, stopped: int, start: float
    ) -> list[Outcome]:
        """Count a batch in the replica's stats; its outcomes, every call's filled in."""
        with self._stats_lock:
            self.batches += ran
            self.calls += calls
            self.skipped += skipped
            self.cancelled += stopped
            self.busy_s += time.perf_counter() - start
        return [outcome for outcome in outcomes if outcome is not None]

    def _health(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Answers the front-end's handshake and its periodic checks; a check (`CHECK`) also runs the
        component's `check_health()` here, on a gRPC thread, off the threads that run batches."""
        self._authorize(context)
        if request != CHECK:
            return b'{"status": "ok"}'
        if not self._checking.acquire(blocking=False):
            context.abort(grpc.StatusCode.UNAVAILABLE, "the check_health() of an earlier check has not returned")
        try:
            self.component.check_health()
        except Exception as exc:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"check_health() raised {type(exc).__name__}: {exc}")
        finally:
            self._checking.release()
        return b'{"status": "ok"}'

    def _stats(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._authorize(context)
        stats = {"component": self.name, "batches": self.batches, "calls": self.calls, "skipped": self.skipped,
                 "cancelled": self.cancelled, "busy_s": self.busy_s, "uptime_s": time.time() - self.started}
        return json.dumps({**stats, **self._describe(), "component_stats": component_stats(self.component)}).encode()


class _Stream:
    """One front-end stream: batches run as they arrive (in order, or concurrently for methods with
    `max_concurrency`), and their chunks and replies go back through one outbox, in the order they are made."""

    def __init__(self, service: WorkerService) -> None:
        self.service = service
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.serial: queue.SimpleQueue[tuple[Batch, float] | None] = queue.SimpleQueue()
        self.running: dict[int, Batch] = {}  # batch id -> the batch, while it runs
        self.lock = threading.Lock()

    def receive(self, requests: Iterator[bytes]) -> None:
        """Take messages off the stream as they arrive, so that a call's time left counts from its arrival."""
        threading.Thread(target=self._run_serial, name="patchkit-batches", daemon=True).start()
        try:
            for message in requests:
                self._take(message, time.monotonic())
        except Exception:  # noqa: S110 - the stream ended: the front-end closed it or went away
            pass
        finally:
            with self.lock:  # whatever still runs is for nobody now
                for batch in self.running.values():
                    for call in batch.calls:
                        call.cancelled.set()
            self.serial.put(None)

    def replies(self) -> Iterator[bytes]:
        while (message := self.outbox.get()) is not None:
            yield message

    def _take(self, message: bytes, arrived: float) -> None:
        decoded = decode_message(message)
        if isinstance(decoded, Read):
            with self.lock:
                batch = self.running.get(decoded.batch_id)
                window = batch.calls[decoded.index].window if batch is not None and decoded.index < len(batch.calls) else None
            if window is not None:
                window.give(decoded.count)
            return
        if not isinstance(decoded, Batch):
            batch_id, index = decoded
            with self.lock:
                batch = self.running.get(batch_id)
                if batch is not None and index < len(batch.calls):
                    batch.calls[index].cancelled.set()
            return
        with self.lock:
            self.running[decoded.batch_id] = decoded
        if decoded.method in self.service.concurrency and decoded.method in self.service.asynchronous:
            component_loop().start(self._run_async(decoded, arrived))
        elif decoded.method in self.service.concurrency:
            self.service.pool.submit(self._run, decoded, arrived)
        else:
            self.serial.put((decoded, arrived))

    def _run_serial(self) -> None:
        while (item := self.serial.get()) is not None:
            self._run(*item)
        self.outbox.put(None)

    def _run(self, batch: Batch, arrived: float) -> None:
        with self._running(batch):
            outcomes = self.service.run(batch.method, batch.calls, arrived, self._sink(batch))
        self.outbox.put(encode_outcomes(batch.batch_id, outcomes))

    async def _run_async(self, batch: Batch, arrived: float) -> None:
        """A batch of an async method with max_concurrency, as a task on the component loop."""
        with self._running(batch):
            outcomes = await self.service.run_async(batch.method, batch.calls, arrived, self._sink(batch))
        self.outbox.put(encode_outcomes(batch.batch_id, outcomes))

    @contextlib.contextmanager
    def _running(self, batch: Batch) -> Iterator[None]:
        """Around a batch's run: cancels and reads reported for its calls reach them until it has run."""
        try:
            yield
        finally:
            with self.lock:
                self.running.pop(batch.batch_id, None)

    def _sink(self, batch: Batch) -> Callable[[int, str], None] | None:
        """Where a batch's chunks go: to the outbox, for the calls whose chunks are wanted (None: none are)."""
        if not any(call.streamed for call in batch.calls):
            return None

        def send(index: int, text: str) -> None:
            if batch.calls[index].streamed:
                self.outbox.put(encode_chunk(batch.batch_id, index, text))

        return send


def _windows(calls: Iterable[WireCall]) -> list[ChunkWindow | None]:
    """The windows of the calls whose chunks the front-end reads as they come (and reports reading)."""
    return [call.window for call in calls]


def _traces(calls: Iterable[WireCall]) -> list[dict[str, str] | None] | None:
    """The calls' trace contexts for their execution span; None when none is traced."""
    traced = [call.trace for call in calls]
    return traced if any(trace is not None for trace in traced) else None

