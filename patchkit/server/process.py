"""Serving a pipeline: the front-end and its HTTP site on one event loop, in one of three homes.

- `python -m patchkit.server.process`: the front-end process `deploy(backend="local")` starts
  (bootstrap and lifeline as in `orchestrator/process.py`); SIGTERM drains it and stops its workers.

In each, the server listens before the workers start and until the requests in flight have drained,
so its probes (`/healthz`, `/readyz`) answer throughout: a load balancer sees it not ready until its
workers are up, and from the moment it is told to stop.
- `serve_blocking`: `patchkit serve FILE.py` in the foreground; Ctrl-C drains and stops.
- `ServerThread`: `deploy(backend="inprocess")`, a thread of the user's process.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pickle
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from patchkit import telemetry
from patchkit.config import DeploymentConfig
from patchkit.config.backends import make_backend
from patchkit.errors import PatchkitError
from patchkit.orchestrator.process import ChildSide, Message
from patchkit.server.connections import EdgeRunner
from patchkit.server.http import build_app, input_schema_field
from patchkit.server.loop_lag import LoopLag
from patchkit.server.request_ids import RequestIdFilter
from patchkit.serving.frontend import Frontend

if TYPE_CHECKING:
    from patchkit.program.pipeline import Pipeline  # the top layer: a type only

__all__ = ["FrontendBootstrap", "FrontendServer", "ServerThread", "serve_blocking"]

logger = logging.getLogger(__name__)

# At close, once requests in flight have drained: how long the connections still busy get to finish
# (a reply being written) before they are cut. Whatever is still busy then is no request being
# served: a body still arriving (a new request is refused anyway) or one that outlived the drain.
_CONNECTION_GRACE_S = 1.0

LOG_FORMAT = "%(asctime)s %(levelname)s front-end %(name)s [%(request_id)s]: %(message)s"


class FrontendServer:
    """The front-end of `pipelines` (one, or several by name) and its HTTP site."""

    def __init__(self, pipelines: Pipeline | Mapping[str, Pipeline], config: DeploymentConfig) -> None:
        self.config = config
        self.frontend = Frontend(pipelines, config, make_backend(config))
        self.loop_lag = LoopLag()
        self._runner: web.AppRunner | None = None
        self._app = build_app(self.frontend, self.loop_lag)
        self.url = ""

    async def start(self) -> str:
        """Listen, then start every replica; returns the URL once they are up. While they start the server
        answers its probes (`/readyz`: 503 "starting") and refuses the rest with 503. Raises (with nothing
        left running) on failure."""
        self.loop_lag.start()
        try:
            self.url = await self._listen()
            logger.info("listening at %s; starting the workers (GET /readyz answers 200 once they are up)", self.url)
            await self.frontend.start()
        except BaseException:
            await self._stop_listening()
            await self.loop_lag.stop()
            raise
        return self.url

    async def _listen(self) -> str:
        read_timeout_s = self.config.server.read_timeout_s
        self._runner = EdgeRunner(
            self._app,
            access_log=None,
            handle_signals=False,
            keepalive_timeout=read_timeout_s,  # no complete request headers for this long: the connection closes
            lingering_time=min(10.0, read_timeout_s),  # reading what is left of a refused body, so its client sees the reply
            auto_decompress=False,  # http.py decodes bodies, bounded, and answers a bad encoding with 400
            shutdown_timeout=_CONNECTION_GRACE_S,
            handler_cancellation=True,  # a client that goes away cancels its request
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.server.host, self.config.server.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def update(self, pipelines: Mapping[str, Pipeline], remove: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
        """`Frontend.update`; the versions it made, described as `GET /v1/pipelines` lists them."""
        made = await self.frontend.update(pipelines, remove)
        return self.frontend.describe_made(made, input_schema_field(self._app))

    async def close(self) -> None:
        """Drain in-flight requests while still answering (new requests get 503, `/readyz` "draining"), then
        stop taking connections, stop every worker, close every connection.

        Takes the drain timeout and a few seconds whatever clients do: a connection still busy after the
        drain (a stalled body, a client not reading its reply) gets `_CONNECTION_GRACE_S`, then is cut.
        """
        await self.frontend.drain()
        if self._runner is not None:
            for site in list(self._runner.sites):
                await site.stop()
        await self.frontend.close()
        await self.loop_lag.stop()
        await self._stop_listening()

    async def _stop_listening(self) -> None:
        if self._runner is None:
            return
        for site in list(self._runner.sites):
            await site.stop()
        server = self._runner.server
        if server is not None:
            server.pre_shutdown()  # idle keep-alive connections close now; busy ones after their reply
            await server.shutdown(_CONNECTION_GRACE_S)
        await self._runner.cleanup()
        self._runner = None


async def _serve_until(server: FrontendServer, stop: asyncio.Event, on_ready: Callable[[FrontendServer], None]) -> None:
    await server.start()
    on_ready(server)
    try:
        await stop.wait()
    finally:
        await server.close()


def serve_blocking(pipelines: Pipeline | Mapping[str, Pipeline], config: DeploymentConfig,
                   on_ready: Callable[[FrontendServer], None],
                   signals: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)) -> None:
    """Serve in this thread until one of `signals` arrives, then drain and stop; spans are exported
    where the OTEL_* variables say so (`patchkit.telemetry`). `on_ready` is called on the server's loop
    once it serves (its `url`; its `frontend` takes updates on that loop)."""
    telemetry.configure_from_env()

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in signals:
            loop.add_signal_handler(signum, stop.set)
        await _serve_until(FrontendServer(pipelines, config), stop, on_ready)

    asyncio.run(main())


class ServerThread:
    """The front-end on a daemon thread of this process (the inprocess backend)."""

    def __init__(self, pipelines: Pipeline | Mapping[str, Pipeline], config: DeploymentConfig) -> None:
        self._server = FrontendServer(pipelines, config)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="patchkit-frontend", daemon=True)
        self.url = ""

    def start(self) -> str:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self.url

    def _main(self) -> None:
        async def main() -> None:
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            await _serve_until(self._server, self._stop, self._set_url)

        try:
            asyncio.run(main())
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()

    def _set_url(self, server: FrontendServer) -> None:
        self.url = server.url
        self._ready.set()

    def update(self, pipelines: Mapping[str, Pipeline], remove: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
        """`Frontend.update` on the front-end's loop, from another thread; the versions now served, described."""
        if self._loop is None or not self._thread.is_alive():
            raise PatchkitError("the endpoint is closed")
        return asyncio.run_coroutine_threadsafe(self._server.update(pipelines, remove), self._loop).result()

    def close(self) -> None:
        """Drain and stop; returns once the front-end's thread has ended."""
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join()


@dataclass
class FrontendBootstrap:
    """What `deploy(backend="local")` sends its front-end process."""

    pipeline: bytes  # cloudpickled: a Pipeline, or several by name
    config: DeploymentConfig
    sys_path: list[str]


def main() -> None:
    side = ChildSide()
    boot = side.start(FrontendBootstrap)
    # At the deploying process's level (the config carries it), so that what its user asked to see, such as the
    # autoscaler's INFO decisions, reaches its stderr, which this process shares.
    logging.basicConfig(level=boot.config.server.log_level or logging.WARNING, format=LOG_FORMAT, force=True)
    _stamp_request_ids()

    def ready(server: FrontendServer) -> None:
        side.answer_with(functools.partial(_update, server, asyncio.get_running_loop()))
        side.ready(url=server.url, pid=os.getpid())

    try:
        pipelines = pickle.loads(boot.pipeline)  # noqa: S301 - from our parent, over a private pipe
        serve_blocking(pipelines, boot.config, ready, signals=(signal.SIGTERM,))
    except BaseException as exc:
        logger.exception("the front-end failed")
        side.failed(exc)
        raise SystemExit(1) from None


def _update(server: FrontendServer, loop: asyncio.AbstractEventLoop, message: Message) -> dict[str, Any]:
    """An update `Endpoint.update` sent over the private pipe, applied on the server's loop: the versions it made.

    Withdrawn by the parent (no answer in time), the update is cancelled where it is: before its switch, with
    what it started stopped and nothing changed (this raises CancelledError, answered "withdrawn"); past it
    (the switch has no await), it is applied and its versions are the answer (`Frontend.update`)."""
    request = pickle.loads(message.body)  # noqa: S301 - from our parent, over a private pipe

    async def apply() -> dict[str, dict[str, Any]]:
        task = asyncio.current_task()
        assert task is not None
        message.on_withdraw(functools.partial(loop.call_soon_threadsafe, task.cancel))
        return await server.update(request["pipelines"], request["remove"])

    return {"pipelines": asyncio.run_coroutine_threadsafe(apply(), loop).result()}


def _stamp_request_ids() -> None:
    """Every record the front-end process logs names the request it was logged for (`LOG_FORMAT`)."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)  # until the bootstrap gives the level
    _stamp_request_ids()
    main()
