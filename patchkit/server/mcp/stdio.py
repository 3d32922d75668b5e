"""`patchkit mcp`: the MCP server over stdin and stdout, for clients that start their servers themselves.

The process's own stdout (fd 1) points at stderr and its stdin (fd 0) at the null device from the command's
start (`divert_stdio`), before any target loads: a script's prints, a component's, and every worker process's
(they inherit them) reach stderr, and only the protocol's messages reach the client, written to the stdout the
process was started with; nothing but the session reads the client's stdin. Logs go to stderr. When the client
closes stdin, or SIGTERM or SIGINT arrives, the front-end drains its requests and stops every worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, BinaryIO

from patchkit import telemetry
from patchkit.config import DeploymentConfig
from patchkit.config.backends import make_backend
from patchkit.errors import PatchkitError
from patchkit.server.mcp.routes import INSTALL
from patchkit.serving.frontend import Frontend

if TYPE_CHECKING:
    from patchkit.program.pipeline import Pipeline  # the top layer: a type only

__all__ = ["StdioServer", "Wire", "divert_stdio", "require_sdk"]

logger = logging.getLogger(__name__)

_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def require_sdk() -> None:
    """Raise PatchkitError, saying what to install, where the `mcp` package is not installed."""
    try:
        import mcp.server.stdio  # noqa: F401
    except ModuleNotFoundError as exc:
        raise PatchkitError(f"patchkit mcp needs the mcp package, which is not installed ({exc}): "
                            f"{INSTALL}") from None


@dataclass(frozen=True)
class Wire:
    """The stdin and stdout the process was started with: the client's, which only the protocol uses."""

    reading: BinaryIO
    writing: BinaryIO


def divert_stdio() -> Wire:
    """Point fd 1 at stderr and fd 0 at the null device, for this process and the processes it starts; returns
    the stdin and stdout it had, the wire to the client."""
    import sys

    sys.stdout.flush()
    wire = Wire(os.fdopen(os.dup(0), "rb", buffering=0), os.fdopen(os.dup(1), "wb", buffering=0))
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # a print reaches stderr when made, among the log's lines
    return wire


class ClientInput:
    """The client's messages, a line each, read on the event loop; `end()` ends them as the client closing stdin
    would, so that SIGTERM can end the session while the client keeps stdin open (a thread blocked reading it
    could not be stopped). A pipe, a socket or a terminal is read as it comes; a file, through a thread."""

    def __init__(self, source: BinaryIO, limit: int) -> None:
        self._source, self._limit = source, limit
        self._reader: asyncio.StreamReader | None = None
        self.ended_by: str = "stdin closed"

    def end(self, why: str) -> None:
        """Called on the loop (a signal's handler): the session ends once the lines read so far are handled."""
        self.ended_by = why
        if self._reader is not None:
            self._reader.feed_eof()

    async def __aiter__(self) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=self._limit, loop=loop)
        try:
            await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader, loop=loop), self._source)
        except ValueError:  # a regular file: it ends by itself
            for line in await asyncio.to_thread(self._source.readlines):
                yield line.decode("utf-8", "replace")
            return
        self._reader = reader
        while line := await reader.readline():
            yield line.decode("utf-8", "replace")


class StdioServer:
    """The front-end of `pipelines` (one, or several by name), its tools served over stdin and `wire`.

    `frontend` takes updates on the server's loop (`update`, as `FrontendServer.update`, for `--reload`).
    """

    def __init__(self, pipelines: Pipeline | Mapping[str, Pipeline], config: DeploymentConfig, wire: Wire) -> None:
        self.config = config
        self.frontend = Frontend(pipelines, config, make_backend(config))
        self._wire = wire

    async def update(self, pipelines: Mapping[str, Pipeline], remove: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
        """`Frontend.update`; the versions it made, described as `GET /v1/pipelines` lists them."""
        return self.frontend.describe_made(await self.frontend.update(pipelines, remove))

    async def serve(self, on_ready: Callable[[StdioServer], None]) -> None:
        """Start the workers, call `on_ready`, serve until stdin ends, then drain and stop every worker."""
        import anyio
        from mcp.server.stdio import stdio_server

        from patchkit.server.mcp.tools import PipelineTools

        telemetry.configure_from_env()
        await self.frontend.start()
        tools = PipelineTools(self.frontend)
        try:
            tools.start()
            on_ready(self)
            writing = anyio.wrap_file(io.TextIOWrapper(self._wire.writing, encoding="utf-8", write_through=True))
            client = ClientInput(self._wire.reading, self.config.limits.max_body_bytes + 1024)
            with _ending_on_signals(client):
                async with stdio_server(stdin=client, stdout=writing) as (reading, writing):  # type: ignore[arg-type]
                    await tools.server.run(reading, writing, tools.server.create_initialization_options())
            logger.info("%s: draining the requests in flight, then stopping the workers", client.ended_by)
        finally:
            tools.stop()
            await self.frontend.close()


@contextlib.contextmanager
def _ending_on_signals(client: ClientInput) -> Iterator[None]:
    """SIGTERM and SIGINT end the client's input, as its closing stdin does, while the block runs."""
    loop = asyncio.get_running_loop()
    for signum in _SIGNALS:
        loop.add_signal_handler(signum, client.end, f"{signal.Signals(signum).name} arrived")
    try:
        yield
    finally:
        for signum in _SIGNALS:
            loop.remove_signal_handler(signum)
