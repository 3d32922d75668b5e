"""Calls from a worker's component to the components it holds that are deployed on their own.

A component passed to another's constructor (a Grader given the pipeline's `llm`) is deployed once:
the holder's worker does not load a private copy of it. It marks that held object as served
elsewhere, and runs its component under a `HandleHook` that sends the holder's calls of it to the
front-end's `CallService`, which queues them in the held component's own batching queue, as a
pipeline call: its replicas, its batches, its prefix routing. This is Ray Serve's deployment handle,
made from the object the user already passed.

The service is a unary gRPC method on the front-end, on 127.0.0.1, with the deployment's secret
checked before a byte is unpickled, as on the workers.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from patchkit.capture.holders import constructor_components
from patchkit.core import CallSite, Component, MakeMethod, mark_served_elsewhere
from patchkit.errors import CallError
from patchkit.orchestrator.execute import Failure, Outcome
from patchkit.orchestrator.rpc import OPTIONS, SECRET_KEY, decode, encode

__all__ = ["CallService", "HandleHook", "Handles", "held_elsewhere"]

logger = logging.getLogger(__name__)

SERVICE = "patchkit.Frontend"
CALL = f"/{SERVICE}/Call"

# Runs one call of (component uid, method) on the front-end: its outcome.
Submit = Callable[[str, str, tuple[Any, ...], dict[str, Any]], Awaitable[Outcome]]


@dataclass(frozen=True)
class Handles:
    """What a replica needs to call the components deployed on their own: the front-end's `CallService`
    address, their uids, and how long one such call may take."""

    address: str
    uids: frozenset[str]
    timeout_s: float

    def hook(self, component: Component, secret: str) -> HandleHook | None:
        """The hook `component` runs under, its held deployed components marked as served elsewhere;
        None when it holds none. Called by the worker before the component's `setup()`."""
        if not held_elsewhere(component, self.uids):
            return None
        return HandleHook(self.address, secret, self.uids, self.timeout_s)


class CallService:
    """The front-end's side: takes the calls workers' components make to shared components."""

    def __init__(self, submit: Submit, secret: str) -> None:
        self._submit = submit
        self._secret = secret
        self._server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self, host: str = "127.0.0.1") -> str:
        """Serve on `host` with a free port; returns the address workers reach it at."""
        self._server = grpc.aio.server(options=OPTIONS)
        handler = grpc.method_handlers_generic_handler(SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(self._call)})
        self._server.add_generic_rpc_handlers((handler,))
        port = self._server.add_insecure_port(f"{host}:0")
        await self._server.start()
        self.address = f"{host}:{port}"
        return self.address

    async def _call(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        given = dict(context.invocation_metadata() or ()).get(SECRET_KEY, "")
        if not (isinstance(given, str) and hmac.compare_digest(given.encode(), self._secret.encode())):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "wrong or missing deployment secret")
        uid, method, args, kwargs = decode(request)
        outcome = await self._submit(uid, method, args, kwargs)
        try:
            return encode(outcome)
        except Exception as exc:  # a result that does not pickle fails its own call
            return encode((False, Failure.on_wire("its result cannot be sent back to the calling worker", exc)))

    async def close(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=1.0)


class HandleHook:
    """The call hook a worker runs its component under: calls of the held components deployed on their
    own (`uids`) go to the front-end at `address`; calls of any other component run here."""

    def __init__(self, address: str, secret: str, uids: Collection[str], timeout_s: float) -> None:
        self.uids = frozenset(uids)
        self._channel = grpc.insecure_channel(address, options=OPTIONS)
        self._call = self._channel.unary_unary(CALL)
        self._metadata = ((SECRET_KEY, secret),)
        self._timeout_s = timeout_s

    def __call__(
        self, component: Component, method: MakeMethod, args: tuple[Any, ...], kwargs: dict[str, Any], site: CallSite | None
    ) -> Any:
        uid = component._patchkit_spec.uid
        if uid not in self.uids:
            return method.run_local(component, args, kwargs)
        name = type(component).__name__
        try:
            message = encode((uid, method.name, args, kwargs))
        except Exception as exc:
            raise CallError(name, method.name, f"its arguments cannot be sent: they do not pickle: {exc}") from None
        try:
            reply = self._call(message, metadata=self._metadata, timeout=self._timeout_s)
        except grpc.RpcError as exc:
            raise CallError(name, method.name, f"the front-end did not run it: {exc.code().name}: {exc.details()}") from None
        ok, value = decode(reply)
        if ok:
            return value
        value.raise_for(name, method.name)


def held_elsewhere(component: Component, deployed: Collection[str]) -> list[Component]:
    """The components passed to `component`'s constructor (at any depth) that are deployed on their
    own (their uid in `deployed`), each marked as served elsewhere: it never loads here."""
    held = [inner for _, inner in constructor_components(component) if inner._patchkit_spec.uid in deployed]
    for inner in held:
        mark_served_elsewhere(inner)
    return held
