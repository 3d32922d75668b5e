"""The MCP server over a front-end's pipelines: a tool per pipeline, a call per query (see `patchkit.server.mcp`).

Built on the `mcp` SDK's low-level `Server`; both transports (`routes.py`, `stdio.py`) serve this one. Imports
the SDK, so it is imported only where MCP is served.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Callable
from typing import Any

import mcp_types as types
from mcp.server.connection import Connection
from mcp.server.context import ServerRequestContext
from mcp.server.lowlevel import NotificationOptions, Server
from mcp.server.models import InitializationOptions
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ToolsListChanged
from mcp.shared.exceptions import MCPError
from mcp.shared.jsonrpc_dispatcher import progress_token_from_params

from patchkit.errors import InputError, PipelineNotFound
from patchkit.server.events import pump
from patchkit.server.inputs import InputSchema, output_json
from patchkit.server.openapi import distribution_version
from patchkit.server.replies import REQUEST_ID_HEADER, error_reply
from patchkit.server.request_ids import REQUEST_ID, check_request_id, new_request_id
from patchkit.serving.frontend import Frontend, RequestResult, Version
from patchkit.serving.steps import StepEvent

__all__ = ["INSTRUCTIONS", "PipelineTools", "describe", "output_schema"]

logger = logging.getLogger(__name__)

INSTRUCTIONS = ("Each tool runs one RAG pipeline this server deploys and answers with its output: JSON text, or the "
                "text itself where the pipeline answers with a string. Arguments are the pipeline's inputs.")
REQUEST_ID_META = "patchkit/request_id"  # the query's id in a result's `_meta`, as `X-Request-ID` names it over HTTP
VERSION_META = "patchkit/version"  # the version that ran it, as the `X-Pipeline-Version` header names it


class _ToolsServer(Server[Any]):
    """The SDK's low-level server, advertising `tools.listChanged` on handshake-era connections too (a new version,
    or a pipeline added or removed, changes the list)."""

    def create_initialization_options(self, notification_options: NotificationOptions | None = None,
                                      experimental_capabilities: dict[str, dict[str, Any]] | None = None,
                                      extensions: dict[str, dict[str, Any]] | None = None) -> InitializationOptions:
        """As the SDK's, with `tools_changed` set unless the caller says otherwise."""
        chosen = notification_options or NotificationOptions(tools_changed=True)
        return super().create_initialization_options(chosen, experimental_capabilities, extensions)


class PipelineTools:
    """A tool per pipeline `frontend` serves; a call runs the pipeline as `POST /v1/query` does.

    `schema`: the inputs a version takes (the HTTP app's cached `schema_of`); by default made from the pipeline
    and the deployment's optional inputs. `server`: the SDK server a transport runs. `start` (on the front-end's
    loop) tells connected clients when the tools change, until `stop`.
    """

    def __init__(self, frontend: Frontend, schema: Callable[[Version], InputSchema] | None = None) -> None:
        self.frontend = frontend
        self._schema = schema or self._own_schema
        self._schemas: weakref.WeakKeyDictionary[Version, InputSchema] = weakref.WeakKeyDictionary()
        self._tools: weakref.WeakKeyDictionary[Version, types.Tool] = weakref.WeakKeyDictionary()
        self.bus = InMemorySubscriptionBus()  # modern connections' `subscriptions/listen` streams
        self._listen = ListenHandler(self.bus)
        self._legacy: weakref.WeakSet[Connection] = weakref.WeakSet()  # handshake-era connections, while open
        self._changes: set[asyncio.Task[None]] = set()
        self._stop_listening: Callable[[], None] | None = None
        self.server = _ToolsServer("patchkit", version=distribution_version(), instructions=INSTRUCTIONS,
                                   on_list_tools=self.list_tools, on_call_tool=self.call_tool,
                                   on_subscriptions_listen=self._listen, get_tool_input_schema=self.input_schema)
        self.server.middleware.append(self._remember)

    # -- lifetime ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Hear the front-end's updates from now on; called on its loop by the transport that serves."""
        if self._stop_listening is None:
            self._stop_listening = self.frontend.on_change(self.changed)

    def stop(self) -> None:
        """Stop hearing updates, and end the open `subscriptions/listen` streams (gracefully)."""
        if self._stop_listening is not None:
            self._stop_listening()
            self._stop_listening = None
        self._listen.close()

    def changed(self) -> None:
        """The tools changed (an update): `notifications/tools/list_changed` to every connected client, on the
        `subscriptions/listen` streams of 2026-era clients and on the connection of handshake-era ones."""
        task = asyncio.get_running_loop().create_task(self._announce())
        self._changes.add(task)
        task.add_done_callback(self._changes.discard)

    async def _announce(self) -> None:
        await self.bus.publish(ToolsListChanged())
        for connection in list(self._legacy):
            await connection.send_tool_list_changed()  # best-effort: a closed one drops it

    async def _remember(self, ctx: ServerRequestContext[Any, Any], call_next: Any) -> Any:
        """Middleware: note each handshake-era connection, to tell it of changes while it is open."""
        result = await call_next(ctx)
        if ctx.method == "initialize":
            connection = _connection_of(ctx)
            if connection is not None:
                self._legacy.add(connection)
        return result

    # -- the tools --------------------------------------------------------------------------------------------
    async def list_tools(self, ctx: ServerRequestContext[Any, Any], params: types.PaginatedRequestParams | None
                         ) -> types.ListToolsResult:
        """`tools/list`: a tool per pipeline served now, by its name."""
        return types.ListToolsResult(tools=[self.tool(version) for version in self.frontend.versions.values()])

    def tool(self, version: Version) -> types.Tool:
        """The tool of `version`: its pipeline's name, description, inputs and (for a dict output) output."""
        if version not in self._tools:
            self._tools[version] = types.Tool(name=version.name, description=describe(version),
                                              input_schema=self._schema(version).json_schema(),
                                              output_schema=output_schema(version))
        return self._tools[version]

    def input_schema(self, name: str) -> dict[str, Any] | None:
        """The `inputSchema` of tool `name` (None: no such tool), read by the SDK to check a call's headers."""
        version = self.frontend.versions.get(name)
        return self.tool(version).input_schema if version is not None else None

    async def call_tool(self, ctx: ServerRequestContext[Any, Any], params: types.CallToolRequestParams
                        ) -> types.CallToolResult:
        """`tools/call`: a query of the pipeline named, on its version serving now, as `POST /v1/query` runs it.

        A bad argument, and any error of the query, is a tool error (`isError`) with its message and no
        traceback; an unknown tool is a protocol error. Where the client sent a progress token, each step event
        (a component call starting or ending) is a progress notification. The client's cancellation (its
        `notifications/cancelled`, or a closed HTTP request) cancels the query, as a client that disconnects does.
        """
        try:
            version = self.frontend.route(params.name)
        except PipelineNotFound:
            raise MCPError(types.INVALID_PARAMS, f"no tool {params.name!r}: the tools are "
                                                 f"{', '.join(self.frontend.versions) or 'none'}") from None
        request_id = _request_id(ctx)
        token = REQUEST_ID.set(request_id)
        try:
            inputs = self._schema(version).check(params.arguments or {})
            result = await self._query(ctx, version, inputs, request_id)
        except InputError as exc:
            return _tool_error(str(exc), request_id)
        except Exception as exc:
            _, payload = error_reply(exc, debug=False)  # a tool's error is read by a model: never a traceback
            error = payload["error"]
            return _tool_error(f"{error['type']}: {error['message']}", request_id)
        finally:
            REQUEST_ID.reset(token)
        return self._result(version, result)

    async def _query(self, ctx: ServerRequestContext[Any, Any], version: Version, inputs: dict[str, Any],
                     request_id: str) -> RequestResult:
        if progress_token_from_params(ctx.params) is None or self.frontend.config.server.steps == "off":
            return await version.runner.query(inputs, request_id=request_id)  # no progress asked for, or offered
        sent = 0

        async def progress(step: StepEvent) -> None:
            nonlocal sent
            sent += 1
            await ctx.session.report_progress(sent, None, step_message(step))

        return await pump(lambda report: version.runner.query(inputs, request_id=request_id, on_step=report), progress)

    def _result(self, version: Version, result: RequestResult) -> types.CallToolResult:
        output = result.output
        text = output if isinstance(output, str) else output_json(output).decode()
        structured = json.loads(text) if version.pipeline.graph.output_fields and isinstance(output, dict) else None
        meta = {REQUEST_ID_META: result.request_id, VERSION_META: result.version or version.tag}
        return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=structured,
                                    _meta=meta)

    def _own_schema(self, version: Version) -> InputSchema:
        if version not in self._schemas:
            optional = self.frontend.config.server.optional_inputs
            self._schemas[version] = InputSchema(version.pipeline.inputs, optional)
        return self._schemas[version]


def describe(version: Version) -> str:
    """A tool's description: the docstring of the pipeline's function, else what its graph calls and returns."""
    pipeline = version.pipeline
    if pipeline.doc:
        return pipeline.doc
    calls = list(dict.fromkeys(f"{node.component}.{node.method}" for node in pipeline.graph.nodes.values()))
    fields = pipeline.graph.output_fields
    returns = f"an object with {', '.join(fields)}" if fields else "its output"
    return f"Runs the {version.name} pipeline: calls {', '.join(calls)}; returns {returns}."


def output_schema(version: Version) -> dict[str, Any] | None:
    """The structured output of a pipeline that answers with a dict of known fields (the graph's `output_fields`),
    as JSON Schema: each field any JSON value; None for any other output (answered as text only)."""
    fields = version.pipeline.graph.output_fields
    if not fields:
        return None
    return {"type": "object", "properties": {name: {} for name in fields}, "required": list(fields)}


def step_message(step: StepEvent) -> str:
    """A step event (`patchkit.serving.steps`) as a progress message: the call, and how it ended; never a
    preview of its result."""
    call = f"{step['component']}.{step['method']}"
    if step["phase"] == "start":
        return f"{call} started"
    if "error" in step:
        return f"{call} failed: {step['error']['type']}"
    return f"{call} done in {step.get('duration_ms') or 0:.0f} ms"


def _tool_error(message: str, request_id: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=message)], is_error=True,
                                _meta={REQUEST_ID_META: request_id})


def _request_id(ctx: ServerRequestContext[Any, Any]) -> str:
    """The id the query runs under: the HTTP request's (its `X-Request-ID`, checked at the edge, or the one the
    edge made), else a fresh one (stdio)."""
    headers = getattr(ctx.request, "headers", None)
    given = headers.get(REQUEST_ID_HEADER) if headers is not None else None
    return check_request_id(given) if given else new_request_id()


def _connection_of(ctx: ServerRequestContext[Any, Any]) -> Connection | None:
    """The connection a request came on. The SDK's low-level context does not carry it (its `Context.connection`
    is not handed to low-level handlers), so it is read from the request's session; None where that changes."""
    connection = getattr(ctx.session, "_connection", None)
    return connection if isinstance(connection, Connection) else None
