"""The `patchkit` command: its parser and commands in `commands.py`, what `serve` serves and how it loads it in
`targets.py`. `patchkit serve [NAME=]FILE.py|module:attribute ... [--config deploy.yaml] [--reload]`
serves the pipelines scripts capture (or modules hold), by name, with options from a config file (config/file.py)
and flags, and with --reload serves a new version of each when its file changes (reload.py); `patchkit mcp ...` takes
the same and serves the pipelines as MCP tools over stdin and stdout (server/mcp/); `patchkit plan
FILE.py` prints the plan the offline planner makes for it, `patchkit demo` deploys the CRAG example on real
components and asks it questions, `patchkit bench URL` sends load to an endpoint and reports its latency,
throughput and SLO attainment, and `patchkit doctor` prints what a bug report needs and checks each part
that runs native code in a process of its own (patchkit/doctor/)."""

from patchkit.cli.commands import main, parser

__all__ = ["main", "parser"]
