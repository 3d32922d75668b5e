"""The wire between the front-end and a worker: gRPC generic handlers carrying raw bytes.

One bidirectional stream per (front-end, replica) carries batches: the front-end writes
`(batch_id, method, calls)` messages, the worker answers `(batch_id, outcomes)` in order. A stream
moves about twice the messages per second of unary calls, and keeps one batch in flight on the
wire while the worker runs the previous one. `Health` and `Stats` are unary JSON calls.

Every RPC carries the deployment's secret in its metadata; the worker checks it before it reads,
let alone unpickles, a single payload byte.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import pickle
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import cloudpickle
import grpc
import grpc.aio

from patchkit.component import Call, Component
from patchkit.errors import WorkerDiedError
from patchkit.orchestrator.execute import Failure, Outcome, component_stats, run_batch

__all__ = ["GrpcChannel", "WorkerService", "decode", "encode"]

SERVICE = "patchkit.Worker"
BATCHES = f"/{SERVICE}/Batches"
HEALTH = f"/{SERVICE}/Health"
STATS = f"/{SERVICE}/Stats"
SECRET_KEY = "x-patchkit-secret"  # noqa: S105 - the metadata key, not a secret
MAX_MESSAGE_BYTES = 1 << 30
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
SERVER_OPTIONS = [*OPTIONS, ("grpc.so_reuseport", 0)]


def encode(value: Any) -> bytes:
    return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes) -> Any:
    # Only ever called on bytes from the other end of an authenticated stream of this deployment.
    return pickle.loads(data)  # noqa: S301


def encode_outcomes(batch_id: int, outcomes: list[Outcome]) -> bytes:
    """One message for a batch's outcomes; a result or exception that cannot be pickled fails its own call only."""
    try:
        return encode((batch_id, outcomes))
    except Exception:  # noqa: S110 - find the values that do not pickle, below
        pass
    return encode((batch_id, [_picklable(outcome) for outcome in outcomes]))


def _picklable(outcome: Outcome) -> Outcome:
    ok, value = outcome
    try:
        encode(value)
        return outcome
    except Exception as exc:
        if ok:
            return (False, Failure(None, "PicklingError", f"its result ({type(value).__name__}) cannot be pickled: {exc}", ""))
        return (False, Failure(None, value.type_name, value.message, value.traceback))


class WorkerService:
    """The worker's side: runs batches on its component, one at a time, and answers health and stats."""

    def __init__(self, component: Component, name: str, secret: str, describe: Callable[[], dict[str, Any]]) -> None:
        self.component = component
        self.name = name
        self._secret = secret
        self._describe = describe
        self._lock = threading.Lock()  # a replica runs one batch at a time, whatever the number of streams
        self.batches = 0
        self.calls = 0
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
        for message in requests:
            batch_id, method, calls = decode(message)
            yield encode_outcomes(batch_id, self.run(method, calls))

    def run(self, method: str, calls: Sequence[Call]) -> list[Outcome]:
        with self._lock:
            start = time.perf_counter()
            outcomes = run_batch(self.component, method, calls)
            self.busy_s += time.perf_counter() - start
            self.batches += 1
            self.calls += len(calls)
        return outcomes

    def _health(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._authorize(context)
        return b'{"status": "ok"}'

    def _stats(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        self._authorize(context)
        stats = {"component": self.name, "batches": self.batches, "calls": self.calls, "busy_s": self.busy_s}
        stats["uptime_s"] = time.time() - self.started
        return json.dumps({**stats, **self._describe(), "component_stats": component_stats(self.component)}).encode()


class GrpcChannel:
    """The front-end's side of one replica's stream. Lives on the front-end's event loop.

    `run_batch` is called by a batching queue for every batch it sends to this replica. When the
    stream breaks (the worker died), every batch in flight fails with WorkerDiedError and `lost`
    is set, so the caller can retry the calls elsewhere.
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
        self._pending: dict[int, asyncio.Future[list[Outcome]]] = {}
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

    async def run_batch(self, method: str, calls: Sequence[Call]) -> list[Outcome]:
        if self.lost.is_set():
            raise WorkerDiedError(f"replica at {self.address} is gone: {self.lost_reason}")
        batch_id = next(self._ids)
        future: asyncio.Future[list[Outcome]] = asyncio.get_running_loop().create_future()
        self._pending[batch_id] = future
        try:
            async with self._write_lock:
                await self._call.write(encode((batch_id, method, list(calls))))
        except Exception as exc:
            self._lose(f"sending a batch failed: {exc}")
        return await future

    async def _read(self) -> None:
        reason = "the worker closed its stream"
        try:
            while True:
                message = await self._call.read()
                if message is grpc.aio.EOF:
                    break
                batch_id, outcomes = decode(message)
                future = self._pending.pop(batch_id, None)
                if future is not None and not future.done():
                    future.set_result(outcomes)
        except grpc.aio.AioRpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        except asyncio.CancelledError:
            reason = "the channel was closed"
        self._lose(reason)

    def _lose(self, reason: str) -> None:
        if not self.lost.is_set():
            self.lost_reason = reason
            self.lost.set()
        pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(WorkerDiedError(f"replica at {self.address} died with a batch in flight ({reason})"))

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
