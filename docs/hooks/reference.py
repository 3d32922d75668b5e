"""MkDocs hook (mkdocs.yml `hooks:`): the reference pages' generated parts, made when the site is built.

Each marker line of a page becomes what the code says: the `--help` of `patchkit` and of each of its commands
(patchkit/cli/commands.py's parser), the metrics `/metrics` serves (patchkit/server/metrics.py's collector), the deploy
options by group of `patchkit.config.DeploymentConfig` (their field metadata), which built-in methods are declared
`@make(read_only=True)` (read from the components' classes), and the HTTP API's OpenAPI document.

It also keeps internals out of the API reference: each `::: name` entry of `HIDDEN` gets filters that leave out
the members patchkit calls itself (public in Python, since other parts of patchkit call them, but nothing a user
calls). Entries are found by the names users import (`patchkit.Pipeline`), never by module path, so a module
that moves changes nothing here.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

import patchkit
import patchkit.components
from patchkit.config import OPTIONS
from patchkit.core import Component, make_methods

CLI_MARKER = "<!-- the CLI's help, made from patchkit/cli/commands.py -->"
READ_ONLY_MARKER = "<!-- the built-in components' read_only methods, made from patchkit/components/ -->"
MAKE_TABLE_MARKER = "<!-- the built-in components' @make options, made from patchkit/components/ -->"
OPENAPI_MARKER = "<!-- the OpenAPI document, made from patchkit/server/openapi.py -->"
CHANGELOG_MARKER = "<!-- the changelog, made from CHANGELOG.md -->"
ROOT = Path(__file__).resolve().parents[2]
# Members of public classes that patchkit itself calls: left out of the reference, by the entry's public name.
HIDDEN: dict[str, tuple[str, ...]] = {
    "patchkit.Pipeline": ("run", "variables", "recorded_run", "absorb", "component_aliases", "fingerprint", "parallel",
                          "identity"),
    "patchkit.Graph": ("node_for", "node_at", "add_edge", "name_component", "name_held", "name_of", "count_run",
                       "output_sites", "components"),
    "patchkit.components.LlamaCppGenerator": ("tokens", "line", "bodies", "reuse_order", "profile_call"),
    "patchkit.config.DeploymentConfig": ("check_options", "check_arguments", "resolve"),
}
# Classes users get from patchkit, never build: their constructor's parameters are patchkit's business.
MADE_BY_PATCHKIT = ("patchkit.Endpoint", "patchkit.PipelineClient", "patchkit.Stream", "patchkit.AsyncStream",
                    "patchkit.Graph")
DIRECTIVE = re.compile(r"^::: (?P<name>[\w.]+)\n(?P<options>(?:[ \t]+.*\n|\n(?=[ \t]))*)", re.M)
FILTERS: list[str] = []  # mkdocs.yml's filters for the python handler, read by on_config
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


def built_in_methods() -> Iterator[tuple[str, str, Any]]:
    """(class name, method name, its @make method) of every built-in component class `patchkit.components` exports."""
    for name in sorted(patchkit.components.__all__):
        cls = getattr(patchkit.components, name)
        if inspect.isclass(cls) and issubclass(cls, Component):
            for method, made in make_methods(cls).items():
                yield name, method, made


def read_only_list() -> str:
    """Which built-in methods are declared `read_only`, and which are not: a sentence each, from the classes."""
    declared = [f"`{cls}.{method}`" for cls, method, made in built_in_methods() if made.read_only]
    not_declared = [f"`{cls}.{method}`" for cls, method, made in built_in_methods() if not made.read_only]
    lines = [f"- Declared `read_only=True`: {', '.join(declared)}."]
    if not_declared:
        lines.append(f"- Not declared (their calls keep their place): {', '.join(not_declared)}.")
    return "\n".join(lines)


def make_table() -> str:
    """Each built-in component's `@make` methods with their options: read_only, batch, stream, max_concurrency."""
    lines = ["| component | method | `read_only` | `batch` | `stream` | `max_concurrency` | `max_batch_size` |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for cls, method, made in built_in_methods():
        yes = {True: "yes", False: ""}
        lines.append(f"| `{cls}` | `{method}` | {yes[made.read_only]} | {yes[made.batch]} | {yes[made.stream]} | "
                     f"{made.max_concurrency or ''} | {made.max_batch_size} |")
    return "\n".join(lines)


def openapi_document() -> str:
    """The OpenAPI document of every route the API documents, as the front-end serves it (without a deployment's
    own inputs), in a fenced block."""
    from patchkit.server.openapi import ROUTE_DOCS, document

    made = document([(method, path, None) for method, path in ROUTE_DOCS])
    return f"```json\n{json.dumps(made, indent=2)}\n```"


def changelog() -> str:
    """CHANGELOG.md as a page of the site: written once, at the top of the repository, where GitHub shows it."""
    text = (ROOT / "CHANGELOG.md").read_text()
    return text.replace("(docs/upgrading.md", "(upgrading.md")  # the page itself, or an anchor in it


MARKERS: dict[str, Callable[[], str]] = {CLI_MARKER: cli_help, METRICS_MARKER: metrics_table, GROUPS_MARKER: groups_table,
                                         READ_ONLY_MARKER: read_only_list, MAKE_TABLE_MARKER: make_table,
                                         OPENAPI_MARKER: openapi_document, CHANGELOG_MARKER: changelog}


def entry_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options of the `::: name` entry: its own, with filters that hide the members `HIDDEN` names and, for a
    class patchkit makes, its constructor left out of its signature."""
    if name in HIDDEN:
        given = options.get("filters", FILTERS)
        options = {**options, "filters": [*given, *(f"!^{member}$" for member in HIDDEN[name])]}
    if name in MADE_BY_PATCHKIT:
        options = {**options, "merge_init_into_class": False}
    return options


def _with_options(match: re.Match[str]) -> str:
    name = match["name"]
    if name not in HIDDEN and name not in MADE_BY_PATCHKIT:
        return match[0]
    found = yaml.safe_load(match["options"]) if match["options"].strip() else None
    options = entry_options(name, (found or {}).get("options", {}))
    block = yaml.safe_dump({"options": options}, default_flow_style=False, sort_keys=False)
    return f"::: {name}\n" + "".join(f"    {line}\n" for line in block.splitlines())


def on_config(config: Any) -> Any:
    """Called by MkDocs once mkdocs.yml is read: the python handler's filters, which an entry's own filters replace
    (so an entry of `HIDDEN` keeps them)."""
    handler = config["plugins"]["mkdocstrings"].config["handlers"]["python"]
    FILTERS[:] = handler.get("options", {}).get("filters", [])
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Called by MkDocs for every page before it is rendered: each marker line becomes what it names, and each
    entry of `HIDDEN` leaves out patchkit's internals."""
    for marker, make in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, make())
    return DIRECTIVE.sub(_with_options, markdown)
