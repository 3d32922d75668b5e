"""Served pipelines as MCP tools (Model Context Protocol), through the official `mcp` SDK.

    pipeline         -> a tool of its name; its description the docstring of the function holding its
                        capture block, else what its graph calls and returns
    its inputs       -> the tool's `inputSchema` (`InputSchema.json_schema`, as `/openapi.json` has them)
    a dict output    -> an `outputSchema` of its fields, the output as `structuredContent` (and as JSON text)
    tools/call       -> a query of the pipeline's version serving now, as `POST /v1/query` runs it: admission,
                        SLO scheduling, request ids (`_meta["patchkit/request_id"]`), metrics, timeouts
    a step event     -> a `notifications/progress`, where the client sent a progress token
    bad input, error -> a tool error (`isError`) with its message, never a traceback
    cancellation     -> the query cancelled, as a client that disconnects cancels it
    an update        -> `notifications/tools/list_changed` (`Frontend.on_change`): on `subscriptions/listen`
                        streams (2026-era clients), on the connection of handshake-era ones

Two transports serve one `PipelineTools` (tools.py): Streamable HTTP at `/mcp` on the front-end's HTTP server
(routes.py, bridged to aiohttp by asgi.py) and stdin/stdout for `patchkit mcp` (stdio.py). Only tools.py and
what it starts import the SDK (the `mcp` extra: `pip install -e '.[mcp]'`).
"""

from patchkit.server.mcp.routes import PATH, McpRoutes

__all__ = ["PATH", "McpRoutes"]
