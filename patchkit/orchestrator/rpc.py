"""The wire between the front-end and a worker: gRPC generic handlers carrying raw bytes.

One bidirectional stream per (front-end, replica) carries batches: the front-end writes a batch
message, the worker answers with one reply per batch, in order. A stream moves about twice the
messages per second of unary calls, and keeps one batch in flight on the wire while the worker runs
the previous one. `Health` and `Stats` are unary calls.

Every RPC carries the deployment's secret in its metadata; the worker checks it before it reads,
let alone unpickles, a single payload byte.

Each message starts with a fixed header (the batch id, its size, its method), so that a payload
that cannot be unpickled on the other side fails its own calls and nothing else: a call whose
arguments do not pickle fails alone with a CallError before anything is sent, a batch the worker
cannot unpickle or a reply the front-end cannot fails that batch's calls, and the stream goes on.
Only the stream itself breaking is a lost replica.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import pickle
import queue
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cloudpickle
import grpc
import grpc.aio

from patchkit import telemetry
from patchkit.component import Call, Component
from patchkit.errors import DeadlineExceeded, PatchkitError, WorkerDiedError
from patchkit.orchestrator.execute import Failure, Outcome, component_stats, run_batch

__all__ = ["GrpcChannel", "WorkerService", "decode", "decode_batch", "encode", "encode_batch"]

logger = logging.getLogger(__name__)

SERVICE = "patchkit.Worker"
BATCHES = f"/{SERVICE}/Batches"
HEALTH = f"/{SERVICE}/Health"
STATS = f"/{SERVICE}/Stats"
SECRET_KEY = "x-patchkit-secret"  # noqa: S105 - the metadata key, not a secret
CHECK = b"check"  # a Health request with this body also runs the component's check_health()
MAX_MESSAGE_BYTES = 1 << 30
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVER_OPTIONS = [*OPTIONS, ("grpc.so_reuseport", 0)]

# A batch: its id, how its calls are pickled, how many there are, the length of its method's name;
# then the name, then the payload. WHOLE: one pickle of (expires_in, calls, traces). PER_CALL (when the
# whole did not pickle): a pickle of (expires_in, [one pickle per call], traces), so the worker unpickles
# each alone. `traces`: None, or per call its span's context (W3C headers, patchkit.telemetry).
_BATCH = struct.Struct(">QBIH")
WHOLE, PER_CALL = 0, 1
# A reply: its batch's id, then one pickle of its outcomes.
_REPLY = struct.Struct(">Q")


def encode(value: Any) -> bytes:
    return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes | memoryview) -> Any:
    # Only ever called on bytes from the other end of an authenticated stream of this deployment.
    return pickle.loads(data)  # noqa: S301


def encode_batch(
    batch_id: int,
    method: str,
    calls: Sequence[Call],
    expires_in: Sequence[float | None] | None = None,
    traces: Sequence[dict[str, str] | None] | None = None,
) -> tuple[bytes | None, dict[int, Failure]]:
    """The message for a batch, and the calls left out of it because their arguments do not pickle (by index).

    Called by the front-end for every batch it sends. `expires_in`: per call, the seconds its request
    has left (None: no limit); the worker skips a call whose time ran out while it waited there.
    `traces`: per call, its span's context, which the worker's execution span continues. The
    message is None when no call pickles.
    """
    expiries = list(expires_in) if expires_in is not None else [None] * len(calls)
    contexts = list(traces) if traces is not None else None
    failed: dict[int, Failure] = {}
    try:
        mode, payload = WHOLE, encode((expiries, list(calls), contexts))
    except Exception:  # find the calls that do not pickle: they fail alone, the others are sent
        parts: list[bytes] = []
        kept: list[int] = []
        for i, call in enumerate(calls):
            try:
                parts.append(encode(call))
            except Exception as exc:
                failed[i] = Failure.on_wire("its arguments cannot be sent to the worker: they do not pickle", exc)
            else:
                kept.append(i)
        if not parts:
            return None, failed
        kept_contexts = None if contexts is None else [contexts[i] for i in kept]
        remaining = ([expiries[i] for i in kept], parts, kept_contexts)
        mode, payload = PER_CALL, pickle.dumps(remaining, protocol=pickle.HIGHEST_PROTOCOL)
    name = method.encode()
    return _BATCH.pack(batch_id, mode, len(calls) - len(failed), len(name)) + name + payload, failed


def decode_batch(message: bytes) -> tuple[int, str, list[Call | Failure], list[float | None], list[dict[str, str] | None] | None]:
    """A batch message's id, method, calls, their seconds left (None: no limit) and their trace contexts
    (None: none traced), as the worker reads it.

    A call whose arguments cannot be unpickled here comes back as the Failure that is its outcome; if
    the payload as a whole cannot be, every call does. Raises only on a message that is not a batch.
    """
    batch_id, mode, count, length = _BATCH.unpack_from(message)
    method = message[_BATCH.size : _BATCH.size + length].decode()
    payload = memoryview(message)[_BATCH.size + length :]
    try:
        expires_in, items, traces = decode(payload)
    except Exception as exc:
        failure = Failure.on_wire("the worker cannot unpickle the arguments of its batch", exc)
        return batch_id, method, [failure] * count, [None] * count, None
    if mode == PER_CALL:
        calls: list[Call | Failure] = []
        for item in items:
            try:
                calls.append(decode(item))
            except Exception as exc:
                calls.append(Failure.on_wire("the worker cannot unpickle its arguments", exc))
        return batch_id, method, calls, expires_in, traces
    return batch_id, method, items, expires_in, traces


def encode_outcomes(batch_id: int, outcomes: list[Outcome]) -> bytes:
    """One reply for a batch's outcomes; a result or exception that cannot be pickled fails its own call only."""
    try:
        payload = encode(outcomes)
    except Exception:  # find the values that do not pickle, below
        payload = encode([_picklable(outcome) for outcome in outcomes])
    return _REPLY.pack(batch_id) + payload


def _picklable(outcome: Outcome) -> Outcome:
    ok, value = outcome
    try:
        encode(value)
        return outcome
    except Exception as exc:
        if ok:
            return (False, Failure.on_wire(f"its result ({type(value).__name__}) cannot be sent back: it does not pickle", exc))
        return (False, Failure(None, value.type_name, value.message, value.traceback, value.source))


class WorkerService:
    """The worker's side: runs batches on its component, one at a time, and answers health and stats."""

    def __init__(self, component: Component, name: str, secret: str, describe: Callable[[], dict[str, Any]]) -> None:
        self.component = component
        self.name = name
        self._secret = secret
        self._describe = describe
        self._lock = threading.Lock()  # a replica runs one batch at a time, whatever the number of streams
        self._checking = threading.Lock()  # one check_health() at a time: a hung one fails the next checks
        self.batches = 0
        self.calls = 0
        self.skipped = 0  # calls not run: their request had run out of time before the worker reached them
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
        # A thread takes messages off the stream as they arrive, so that a call's time left counts from
        # its arrival, not from when the batch before it is done.
        inbox: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()

        def receive() -> None:
            try:
                for message in requests:
                    inbox.put((time.monotonic(), message))
            except Exception:  # noqa: S110 - the stream ended: the front-end closed it or went away
                pass
            finally:
                inbox.put(None)

        threading.Thread(target=receive, name="patchkit-stream", daemon=True).start()
        while (item := inbox.get()) is not None:
            arrived, message = item
            batch_id, method, calls, expires_in, traces = decode_batch(message)
            deadlines = [None if left is None else arrived + left for left in expires_in]
            yield encode_outcomes(batch_id, self.run(method, calls, deadlines, traces))

    def run(
        self,
        method: str,
        calls: Sequence[Call | Failure],
        deadlines: Sequence[float | None] | None = None,
        traces: Sequence[dict[str, str] | None] | None = None,
    ) -> list[Outcome]:
        """Run a batch's calls once the replica is free; those already failed (their arguments did not
        unpickle) or past their deadline (`time.monotonic()`; their request has been answered) are not run.
        `traces`: per call, its span's context: the calls that run do so in execution spans continuing them."""
        with self._lock:
            start = time.perf_counter()
            now = time.monotonic()
            outcomes: list[Outcome | None] = [None] * len(calls)
            runnable: dict[int, Call] = {}
            for i, call in enumerate(calls):
                deadline = deadlines[i] if deadlines is not None else None
                if isinstance(call, Failure):
                    outcomes[i] = (False, call)
                elif deadline is not None and now >= deadline:
                    late = DeadlineExceeded("its request ran out of time before the worker reached it: the call was not run")
                    outcomes[i] = (False, Failure.verdict(late))
                    self.skipped += 1
                else:
                    runnable[i] = call
            if runnable:
                contexts = None if traces is None else [traces[i] for i in runnable]
                with telemetry.execution(self.name, method, contexts):
                    ran = run_batch(self.component, method, list(runnable.values()))
                for i, outcome in zip(runnable, ran):
                    outcomes[i] = outcome
                self.batches += 1
                self.calls += len(runnable)
            self.busy_s += time.perf_counter() - start
        return [outcome for outcome in outcomes if outcome is not None]

    def _health(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Answers the front-end's handshake and its periodic checks; a check (`CHECK`) also runs the
        component's `check_health()` here, on a gRPC thread, off the thread that runs batches."""
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
                 "busy_s": self.busy_s}
        stats["uptime_s"] = time.time() - self.started
        return json.dumps({**stats, **self._describe(), "component_stats": component_stats(self.component)}).encode()


class GrpcChannel:
    """The front-end's side of one replica's stream. Lives on the front-end's event loop.

    `run_batch` is called by a batching queue for every batch it sends to this replica. When the
    stream breaks (the worker died), every batch in flight fails with WorkerDiedError and `lost`
    is set, so the caller can retry the calls elsewhere. Nothing else loses the channel: a call
    that does not pickle, or a reply that does not unpickle, fails its own calls (see the module's
    docstring), and should the stream's reader ever fail, the channel is lost with the reason.
    """

    def __init__(
        self,
        address: str,
        secret: str,
        credentials: grpc.ChannelCredentials | None = None,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        """`credentials`: TLS to the worker (None: plaintext); `options`: further gRPC channel options."""
        self.address = address
        self._metadata = ((SECRET_KEY, secret),)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=[*OPTIONS, *options])
        else:
            self._channel = grpc.aio.secure_channel(address, credentials, options=[*OPTIONS, *options])
        self._pending: dict[int, asyncio.Future[list[Outcome] | Failure]] = {}
        self._ids = itertools.count()
        self._write_lock = asyncio.Lock()
        self._call: Any = None
        self._reader: asyncio.Task[None] | None = None
        self.lost = asyncio.Event()
        self.lost_reason = ""

    async def open(self) -> None:
        """Called once by the backend after the worker reported ready."""
        await asyncio.wait_for(self._channel.channel_ready(), timeout=30)
        health = self._channel.unary_unary(HEALTH)
        await health(b"", metadata=self._metadata, timeout=30)
        self._call = self._channel.stream_stream(BATCHES)(metadata=self._metadata)
        self._reader = asyncio.get_running_loop().create_task(self._read())

    async def run_batch(
        self,
        method: str,
        calls: Sequence[Call],
        expires_in: Sequence[float | None] | None = None,
        traces: Sequence[dict[str, str] | None] | None = None,
    ) -> list[Outcome]:
        """Send a batch and return an outcome per call, in order; raises WorkerDiedError when the replica is lost.

        `expires_in`: per call, the seconds its request has left (None: no limit): the worker does not
        run a call it reaches later than that. `traces`: per call, its span's context, for the worker.
        A call whose arguments do not pickle is not sent: its outcome says so, and the others go.
        """
        if self.lost.is_set():
            raise WorkerDiedError(f"replica at {self.address} is gone: {self.lost_reason}")
        batch_id = next(self._ids)
        message, failed = encode_batch(batch_id, method, calls, expires_in, traces)
        if message is None:
            return [(False, failed[i]) for i in range(len(calls))]
        future: asyncio.Future[list[Outcome] | Failure] = asyncio.get_running_loop().create_future()
        self._pending[batch_id] = future
        try:
            try:
                async with self._write_lock:
                    await self._call.write(message)
            except Exception as exc:  # the stream is broken (the message itself is made above)
                self._lose(f"sending a batch failed: {type(exc).__name__}: {exc}")
            answer = await future
        finally:
            self._pending.pop(batch_id, None)  # answered, or given up on by the caller (a call timeout)
        sent = len(calls) - len(failed)
        outcomes = iter([(False, answer)] * sent if isinstance(answer, Failure) else answer)
        return [(False, failed[i]) if i in failed else next(outcomes) for i in range(len(calls))]

    async def _read(self) -> None:
        """Hand each reply to its batch, until the stream ends; whatever ends it, the channel is lost with the reason."""
        reason = "the worker closed its stream"
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    break
                self._answer(message)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "the channel was closed"
        except Exception as exc:  # a bug: say so, and let the replica be recycled rather than hang its batches
            logger.exception("the stream of the replica at %s failed", self.address)
            reason = f"its stream failed: {type(exc).__name__}: {exc}"
        finally:
            self._lose(reason)

    def _answer(self, message: bytes) -> None:
        (batch_id,) = _REPLY.unpack_from(message)
        future = self._pending.pop(batch_id, None)
        if future is None or future.done():
            return  # its caller gave up on it
        try:
            outcomes = decode(memoryview(message)[_REPLY.size :])
        except Exception as exc:
            logger.warning("a reply of the replica at %s cannot be unpickled: %s: %s", self.address, type(exc).__name__, exc)
            future.set_result(Failure.on_wire("its reply from the worker cannot be unpickled by the front-end", exc))
        else:
            future.set_result(outcomes)

    def _lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(WorkerDiedError(f"replica at {self.address} died with a batch in flight ({reason})"))

    async def health(self, timeout_s: float) -> None:
        """Ask the worker whether it is healthy: it answers within `timeout_s` and its component's
        `check_health()` returns. Raises a PatchkitError saying what failed; called by the supervisor's checks."""
        try:
            await self._channel.unary_unary(HEALTH)(CHECK, metadata=self._metadata, timeout=timeout_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(f"no answer within {timeout_s:g} s") from None
            raise PatchkitError(exc.details() or exc.code().name) from None

    async def stats(self) -> dict[str, Any]:
        data = await self._channel.unary_unary(STATS)(b"", metadata=self._metadata, timeout=10)
        stats: dict[str, Any] = json.loads(data)
        return stats

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        self._lose("the channel was closed")
        await self._channel.close()
