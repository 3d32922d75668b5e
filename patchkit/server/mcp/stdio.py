"""`patchkit mcp`: the MCP server over stdin and stdout, for clients that start their servers themselves.

The process's own stdout (fd 1) points at stderr from the command's start (`divert_stdout`), before any target
loads: a script's prints, a component's, and every worker process's (they inherit it) reach stderr, and only
the protocol's messages reach the client, written to the stdout the process was started with. Logs go to
stderr. When the client closes stdin the front-end drains its requests and stops every worker.
"""

from __future__ import annotations

import io
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from patchkit import telemetry
from patchkit.config import DeploymentConfig
from patchkit.config.backends import make_backend
from patchkit.errors import PatchkitError
from patchkit.server.mcp.routes import INSTALL
from patchkit.serving.frontend import Frontend

if TYPE_CHECKING:
    from patchkit.program.pipeline import Pipeline  # the top layer: a type only

__all__ = ["StdioServer", "divert_stdout", "require_sdk"]

logger = logging.getLogger(__name__)


def require_sdk() -> None:
    """Raise PatchkitError, saying what to install, where the `mcp` package is not installed."""
    try:
        import mcp.server.stdio  # noqa: F401
    except ModuleNotFoundError as exc:
        raise PatchkitError(f"patchkit mcp needs the mcp package, which is not installed ({exc}): "
                            f"{INSTALL}") from None


def divert_stdout() -> BinaryIO:
    """Point fd 1 at stderr, for this process and the processes it starts; returns the stdout it had, the wire."""
    import sys

    sys.stdout.flush()
    wire = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # a print reaches stderr when made, among the log's lines
    return wire


class StdioServer:
    """The front-end of `pipelines` (one, or several by name), its tools served over stdin and `wire`.

    `frontend` takes updates on the server's loop (`update`, as `FrontendServer.update`, for `--reload`).
    """

    def __init__(self, pipelines: Pipeline | Mapping[str, Pipeline], config: DeploymentConfig, wire: BinaryIO) -> None:
        self.config = config
        self.frontend = Frontend(pipelines, config, make_backend(config))
        self._wire = wire

    async def update(self, pipelines: Mapping[str, Pipeline], remove: Sequence[str] = ()) -> dict[str, dict[str, Any]]:
        """`Frontend.update`; the versions it made, described as `GET /v1/pipelines` lists them."""
        versions = await self.frontend.update(pipelines, remove)
        return {row["name"]: row for row in self.frontend.describe() if versions.get(row["name"]) is not None
                and row["version"] == versions[row["name"]].number}

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
            wire = anyio.wrap_file(io.TextIOWrapper(self._wire, encoding="utf-8", write_through=True))
            async with stdio_server(stdout=wire) as (reading, writing):
                await tools.server.run(reading, writing, tools.server.create_initialization_options())
            logger.info("stdin closed: draining the requests in flight, then stopping the workers")
        finally:
            tools.stop()
            await self.frontend.close()
