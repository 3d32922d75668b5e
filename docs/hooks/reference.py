"""MkDocs hook (mkdocs.yml `hooks:`): the reference pages' generated parts, made when the site is built.

Each marker line of a page under docs/reference/ becomes what the code says: the `--help` of `patchkit`
and of each of its commands (patchkit/cli/commands.py's parser), the metrics `/metrics` serves (patchkit/server/metrics.py's
collector), and the deploy options by group of `patchkit.config.DeploymentConfig` (their field metadata).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from typing import Any

from patchkit.config import OPTIONS

CLI_MARKER = "<!-- the CLI's help, made from patchkit/cli/commands.py -->"
METRICS_MARKER = "<!-- the metrics, made from patchkit/server/metrics.py -->"
GROUPS_MARKER = "<!-- the options by group, made from patchkit/config/ -->"
HELP_COLUMNS = "100"  # argparse wraps to $COLUMNS: the page's width, whatever terminal builds the site


def cli_help() -> str:
    """`patchkit --help`, then each command's `--help`, each under its own heading, as the terminal shows them."""
    from patchkit.cli import parser

    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        parts = [_help_section("patchkit", parser())]
        parts += [_help_section(f"patchkit {name}", command) for name, command in _commands(parser())]
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before
    return "\n\n".join(parts)


def _commands(root: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in root._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def _help_section(title: str, command: argparse.ArgumentParser) -> str:
    return f"## `{title}`\n\n```text\n$ {title} --help\n{command.format_help().rstrip()}\n```"


def metrics_table() -> str:
    """The metrics `GET /metrics` serves: name, type, labels, what it counts."""
    from patchkit.server.metrics import catalogue

    lines = ["| metric | type | labels | what it shows |", "| --- | --- | --- | --- |"]
    for name, kind, labels, text in catalogue():
        shown = ", ".join(f"`{label}`" for label in labels)
        lines.append(f"| `{name}` | {kind} | {shown} | {_cell(text)} |")
    return "\n".join(lines)


def groups_table() -> str:
    """Each option by its group of DeploymentConfig: where a config holds it, the name deploy() takes, its help."""
    lines = ["| in the config | deploy() / config-file key | `patchkit serve` flag | what it sets |", "| --- | --- | --- | --- |"]
    for name, spec in OPTIONS.items():
        flag = f"`--{name.replace('_', '-')}`" if spec.option.flag else ""
        lines.append(f"| `config.{spec.path}` | `{name}` | {flag} | {_cell(spec.option.help)} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


MARKERS: dict[str, Callable[[], str]] = {CLI_MARKER: cli_help, METRICS_MARKER: metrics_table, GROUPS_MARKER: groups_table}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Called by MkDocs for every page before it is rendered: each marker line becomes what it names."""
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return markdown
