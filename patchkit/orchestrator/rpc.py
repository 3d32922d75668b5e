"""The wire between the front-end and a worker: gRPC generic handlers carrying raw bytes.

One bidirectional stream per (front-end, replica) carries batches: the front-end writes a batch
message, the worker answers with one reply per batch, in order. A stream moves about twice the
messages per second of unary calls, and keeps one batch in flight on the wire while the worker runs
the previous one. `Health` and `Stats` are unary calls.

Every RPC carries the deployment's secret in its metadata; the worker checks it before it reads,
let alone unpickles, a single payload byte.

A batch says, per call, whether its text chunks are wanted as they are made (a `stream=True` method
whose request streams its output): the worker then sends a chunk message per chunk before the
batch's reply. The front-end may send a cancel message naming one call of a batch in flight (its
request ended): the worker stops a streaming call at its next chunk, and skips a call not started.
The front-end reports the chunks each streamed call's reader has taken (a read message): the worker's
generator runs at most a window (`event_loop.STREAM_BUFFER` chunks) ahead of its reader, so a slow
client slows it instead of filling queues on either side.

Each message starts with a fixed header (the batch id, its size, its method), so that a payload
that cannot be unpickled on the other side fails its own calls and nothing else: a call whose
arguments do not pickle fails alone with a CallError before anything is sent, a batch the worker
cannot unpickle or a reply the front-end cannot fails that batch's calls, and the stream goes on.
Only the stream itself breaking is a lost replica.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import grpc
import grpc.aio

from patchkit.core import Call
from patchkit.core.event_loop import ChunkWindow
from patchkit.errors import DeadlineExceeded, PatchkitError, WorkerDiedError
from patchkit.orchestrator.envelope import CallEnvelope, when_read
from patchkit.orchestrator.execute import Failure, Outcome, StopFlag

__all__ = [
    "Batch",
    "Read",
    "WireCall",
    "GrpcChannel",
    "decode",
    "decode_message",
    "encode",
    "encode_batch",
    "encode_cancel",
    "encode_chunk",
    "encode_outcomes",
    "encode_read",
]

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
# then the name, then the payload: a list with one (expires_in, streamed, trace, call) per call.
# WHOLE: one pickle of that list. PER_CALL (when the whole did not pickle): the same list pickled
# with each call pickled alone inside it, so the worker unpickles each alone. `trace`: None, or the
# call's span's context (W3C headers, patchkit.telemetry). CANCEL: the call at index `count` of the
# batch is to stop; nothing follows. READ: the reader of call `count` has taken `length` more of its
# chunks (so many places free again in its window); nothing follows.
_BATCH = struct.Struct(">QBIH")
WHOLE, PER_CALL, CANCEL, READ = 0, 1, 2, 3
# A reply: its batch's id and kind. OUTCOMES: one pickle of the batch's outcomes follows. CHUNK: the
# call's index (_INDEX) and the chunk's text, UTF-8.
_REPLY = struct.Struct(">QB")
_INDEX = struct.Struct(">I")
OUTCOMES, CHUNK = 0, 1


def encode(value: Any) -> bytes:
    return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes | memoryview) -> Any:
    # Only ever called on bytes from the other end of an authenticated stream of this deployment.
    return pickle.loads(data)  # noqa: S301


@dataclass(eq=False)
class WireCall:
    """One call of a batch as the worker reads it: its arguments (or the Failure they are, when they did
    not unpickle here), the seconds its request had left when sent (None: no limit), whether its chunks
    are wanted as they are made, its span's context (None: not traced), `cancelled`, set when the
    front-end stops it (its request ended) or its stream ends, and `window` (a streamed call's): how far
    its chunks may run ahead of their reader, whose reads the front-end reports (READ)."""

    call: Call | Failure
    expires_in: float | None = None
    streamed: bool = False
    trace: dict[str, str] | None = None
    cancelled: StopFlag = field(default_factory=StopFlag)
    window: ChunkWindow | None = None

    def __post_init__(self) -> None:
        if self.streamed and self.window is None:
            self.window = ChunkWindow()

    def deadline(self, arrived: float) -> float | None:
        """When, on the clock `arrived` was read from, its request runs out of time; None: never."""
        return None if self.expires_in is None else arrived + self.expires_in


@dataclass
class Batch:
    """A batch as the worker reads it: its id, its method, and its calls in order."""

    batch_id: int
    method: str
    calls: list[WireCall]


def encode_batch(
    batch_id: int, method: str, calls: Sequence[CallEnvelope], now: float
) -> tuple[bytes | None, dict[int, Failure]]:
    """The message for a batch, and the calls left out of it because their arguments do not pickle (by index).

    Called by the front-end for every batch it sends, at the event loop's time `now`. From each call's
    envelope it sends the seconds its request has left (the worker skips a call whose time ran out while
    it waited there), whether the worker sends its chunks as they are made, and its span's context,
    which the worker's execution span continues. The message is None when no call pickles.
    """
    failed: dict[int, Failure] = {}
    try:
        mode, payload = WHOLE, encode([_wire(call, call.call, now) for call in calls])
    except Exception:  # find the calls that do not pickle: they fail alone, the others are sent
        parts: list[tuple[Any, ...]] = []
        for i, call in enumerate(calls):
            try:
                parts.append(_wire(call, encode(call.call), now))
            except Exception as exc:
                failed[i] = Failure.on_wire("its arguments cannot be sent to the worker: they do not pickle", exc)
        if not parts:
            return None, failed
        mode, payload = PER_CALL, pickle.dumps(parts, protocol=pickle.HIGHEST_PROTOCOL)
    name = method.encode()
    return _BATCH.pack(batch_id, mode, len(calls) - len(failed), len(name)) + name + payload, failed


def _wire(call: CallEnvelope, arguments: Any, now: float) -> tuple[Any, ...]:
    """What travels of a call: the seconds its request has left, whether its chunks are wanted, its trace, its arguments."""
    return (call.expires_in(now), call.on_chunk is not None, call.trace, arguments)


def encode_cancel(batch_id: int, index: int) -> bytes:
    """The message that stops call `index` (of those sent) of batch `batch_id` at the worker."""
    return _BATCH.pack(batch_id, CANCEL, index, 0)


@dataclass
class Read:
    """A read message as the worker reads it: the reader of call `index` of batch `batch_id` took `count` chunks."""

    batch_id: int
    index: int
    count: int


def encode_read(batch_id: int, index: int, count: int) -> bytes:
    """The message that frees `count` places in the window of call `index` of batch `batch_id` at the worker."""
    return _BATCH.pack(batch_id, READ, index, count)


def decode_message(message: bytes) -> Batch | Read | tuple[int, int]:
    """A batch, a read message, or a cancel message's (batch id, call index), as the worker reads them.

    A call whose arguments cannot be unpickled here comes back as the Failure that is its outcome; if
    the payload as a whole cannot be, every call does. Raises only on a message that is neither.
    """
    batch_id, mode, count, length = _BATCH.unpack_from(message)
    if mode == CANCEL:
        return batch_id, count
    if mode == READ:
        return Read(batch_id, count, length)
    method = message[_BATCH.size : _BATCH.size + length].decode()
    payload = memoryview(message)[_BATCH.size + length :]
    try:
        items = decode(payload)
    except Exception as exc:
        failure = Failure.on_wire("the worker cannot unpickle the arguments of its batch", exc)
        return Batch(batch_id, method, [WireCall(failure) for _ in range(count)])
    calls = [WireCall(_arguments(arguments, mode), expires_in, streamed, trace)
             for expires_in, streamed, trace, arguments in items]
    return Batch(batch_id, method, calls)


def _arguments(arguments: Any, mode: int) -> Call | Failure:
    """A call's arguments as sent: unpickled already (WHOLE), or unpickled now, alone (PER_CALL)."""
    if mode != PER_CALL:
        return arguments
    try:
        return decode(arguments)
    except Exception as exc:
        return Failure.on_wire("the worker cannot unpickle its arguments", exc)


def encode_outcomes(batch_id: int, outcomes: list[Outcome]) -> bytes:
    """One reply for a batch's outcomes; a result or exception that cannot be pickled fails its own call only."""
    try:
        payload = encode(outcomes)
    except Exception:  # find the values that do not pickle, below
        payload = encode([_picklable(outcome) for outcome in outcomes])
    return _REPLY.pack(batch_id, OUTCOMES) + payload


def encode_chunk(batch_id: int, index: int, text: str) -> bytes:
    """A chunk of call `index` of batch `batch_id`, sent as its method makes it."""
    return _REPLY.pack(batch_id, CHUNK) + _INDEX.pack(index) + text.encode("utf-8", "surrogatepass")


def _picklable(outcome: Outcome) -> Outcome:
    ok, value = outcome
    try:
        encode(value)
        return outcome
    except Exception as exc:
        if ok:
            return (False, Failure.on_wire(f"its result ({type(value).__name__}) cannot be sent back: it does not pickle", exc))
        return (False, Failure(None, value.type_name, value.message, value.traceback, value.source))


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
        self._sinks: dict[int, Sequence[Callable[[str], object] | None]] = {}  # batch id -> per call, where chunks go
        self._reads: dict[tuple[int, int], int] = {}  # (batch id, call index) -> chunks read, not yet reported
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

    async def run_batch(self, method: str, calls: Sequence[CallEnvelope]) -> list[Outcome]:
        """Send a batch and return an outcome per call, in order; raises WorkerDiedError when the replica is lost.

        From each call's envelope: the worker does not start a call it reaches after its `expires`; the
        chunks of a `stream=True` method go to its `on_chunk` as the worker makes them; its `ended` future's
        cancellation (its request ended) stops it at the worker; its `trace` goes to the worker. A call
        whose arguments do not pickle is not sent: its outcome says so, and the others go. Cancelling
        this coroutine (the caller gave up on the batch) stops its calls at the worker the same way: a
        call the worker has not started is never run.
        """
        if self.lost.is_set():
            raise WorkerDiedError(f"replica at {self.address} is gone: {self.lost_reason}")
        batch_id = next(self._ids)
        loop = asyncio.get_running_loop()
        message, failed = encode_batch(batch_id, method, calls, loop.time())
        if message is None:
            return [(False, failed[i]) for i in range(len(calls))]
        sent = [call for i, call in enumerate(calls) if i not in failed]  # the worker numbers the calls it got
        future: asyncio.Future[list[Outcome] | Failure] = loop.create_future()
        self._pending[batch_id] = future
        if any(call.on_chunk is not None for call in sent):
            self._sinks[batch_id] = [call.on_chunk for call in sent]
        watched = [(call.ended, lambda f, k=k: self._cancel(batch_id, k, f)) for k, call in enumerate(sent)
                   if call.ended is not None]
        for end, stop in watched:
            end.add_done_callback(stop)
        try:
            try:
                async with self._write_lock:
                    await self._call.write(message)
            except Exception as exc:  # the stream is broken (the message itself is made above)
                self._lose(f"sending a batch failed: {type(exc).__name__}: {exc}")
            answer = await future
        except asyncio.CancelledError:
            self._withdraw(batch_id, len(sent))
            raise
        finally:
            self._pending.pop(batch_id, None)  # answered, or given up on by the caller (a call timeout)
            self._sinks.pop(batch_id, None)
            for end, stop in watched:
                end.remove_done_callback(stop)
        outcomes = iter([(False, answer)] * len(sent) if isinstance(answer, Failure) else answer)
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

    def _cancel(self, batch_id: int, index: int, ended: asyncio.Future[Any]) -> None:
        """A call's request ended while its batch is in flight: tell the worker to stop it."""
        if ended.cancelled() and batch_id in self._pending and not self.lost.is_set():
            asyncio.get_running_loop().create_task(self._write(encode_cancel(batch_id, index)))

    def _read_back(self, batch_id: int, index: int) -> None:
        """A chunk of a call in flight was read: report it to the worker, with the others read meanwhile in one
        message per call (the call's generator waits once it is a window ahead of its reader)."""
        if batch_id not in self._pending or self.lost.is_set():
            return  # answered: nothing waits for the report any more
        key = (batch_id, index)
        if key not in self._reads:
            asyncio.get_running_loop().call_soon(self._report_reads, key)
        self._reads[key] = self._reads.get(key, 0) + 1

    def _report_reads(self, key: tuple[int, int]) -> None:
        count = self._reads.pop(key, 0)
        if count and key[0] in self._pending and not self.lost.is_set():
            asyncio.get_running_loop().create_task(self._write(encode_read(*key, count)))

    def _withdraw(self, batch_id: int, calls: int) -> None:
        """The caller gave up on a batch in flight (a call timeout, or its replica was replaced before it got
        to it): tell the worker to stop its calls, so that it never starts those it has not started when
        the message arrives (it reads messages as they come, while it runs the batch ahead)."""
        if not self.lost.is_set():
            for index in range(calls):
                asyncio.get_running_loop().create_task(self._write(encode_cancel(batch_id, index)))

    async def _write(self, message: bytes) -> None:
        try:
            async with self._write_lock:
                await self._call.write(message)
        except Exception as exc:  # the stream is broken; its reader says why
            logger.debug("a cancel or read message to %s was not sent: %s", self.address, exc)

    def _answer(self, message: bytes) -> None:
        batch_id, kind = _REPLY.unpack_from(message)
        if kind == CHUNK:
            sinks = self._sinks.get(batch_id)
            (index,) = _INDEX.unpack_from(message, _REPLY.size)
            if sinks is not None and index < len(sinks) and (sink := sinks[index]) is not None:
                handed = sink(bytes(memoryview(message)[_REPLY.size + _INDEX.size :]).decode("utf-8", "surrogatepass"))
                when_read(handed, lambda: self._read_back(batch_id, index))
            return
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
