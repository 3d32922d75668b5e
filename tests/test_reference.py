"""The API reference (docs/reference/) covers every public name, and every public name has a docstring.

The reference pages are made by mkdocstrings from `::: identifier` lines: a public name without such a line,
or without a docstring (mkdocstrings leaves out a member that has none), is missing from the site. The
docstrings are checked for their style by ruff's pydocstyle rules (D), in the modules listed in
pyproject.toml; a module that defines a public name must be among them.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import re
import sys
import tomllib
from collections.abc import Iterator
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml

import patchkit
import patchkit.components
import patchkit.config
import patchkit.errors
from patchkit.client.pipeline_client import PipelineClient

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted((ROOT / "docs" / "reference").glob("*.md"))
DIRECTIVE = re.compile(r"^::: (?P<name>[\w.]+)\n(?P<options>(?:[ \t]+.*\n|\n(?=[ \t]))*)", re.M)
# The methods users call (and mkdocstrings shows: the dunders but these are filtered out in mkdocs.yml).
SHOWN_DUNDERS = ("__call__", "__getitem__")


def _public_names() -> dict[str, Any]:
    """Every public name, by the path users write: the `__all__`s of patchkit and patchkit.components, the
    errors, and the classes of patchkit.config."""
    names = {f"patchkit.{n}": getattr(patchkit, n) for n in patchkit.__all__}
    names |= {f"patchkit.components.{n}": getattr(patchkit.components, n) for n in patchkit.components.__all__}
    names |= {f"patchkit.errors.{n}": getattr(patchkit.errors, n) for n in patchkit.errors.__all__}
    names |= {f"patchkit.config.{n}": getattr(patchkit.config, n) for n in patchkit.config.__all__
              if inspect.isclass(getattr(patchkit.config, n))}
    names["patchkit.client.endpoint.PipelineClient"] = PipelineClient
    return names


PUBLIC = _public_names()
# Whose methods are each an entry of the reference: the handles users hold.
WITH_METHODS = [patchkit.Endpoint, PipelineClient, patchkit.Pipeline, patchkit.Plan]


def _resolve(path: str) -> Any:
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            found = getattr(found, part)
        return found
    raise LookupError(path)


def _documented() -> Iterator[Any]:
    """Every object a reference page has an entry for: each `:::` line's, and the members it lists."""
    for page in PAGES:
        for match in DIRECTIVE.finditer(page.read_text()):
            target = _resolve(match["name"])
            options = yaml.safe_load(match["options"]) if match["options"].strip() else {}
            members = (options or {}).get("options", {}).get("members")
            if isinstance(members, list):
                yield from (getattr(target, member) for member in members)
            elif members is not False:
                yield target


def _methods(cls: type) -> Iterator[tuple[str, Any]]:
    for name, member in vars(cls).items():
        if (not name.startswith("_") or name in SHOWN_DUNDERS) and (inspect.isfunction(member) or isinstance(member, property)):
            yield name, member


def test_every_public_name_has_a_docstring() -> None:
    missing = [name for name, obj in PUBLIC.items() if not (inspect.getdoc(obj) or "").strip()]
    assert not missing, f"public names without a docstring: {missing}"


@pytest.mark.parametrize("cls", WITH_METHODS, ids=lambda cls: cls.__name__)
def test_every_public_method_of_the_handles_has_a_docstring(cls: type) -> None:
    """mkdocstrings leaves out a member without a docstring: it would be missing from the reference."""
    missing = [name for name, member in _methods(cls) if not (inspect.getdoc(member) or "").strip()]
    assert not missing, f"{cls.__name__}: methods without a docstring: {missing}"


def test_every_public_name_has_an_entry_in_the_reference() -> None:
    documented = {id(obj) for obj in _documented()}
    missing = [name for name, obj in PUBLIC.items() if id(obj) not in documented]
    assert not missing, f"public names with no `::: name` entry in docs/reference/: {missing}"


class _SiteLoader(yaml.SafeLoader):
    """mkdocs.yml as data: a `!!python/name:` tag (a superfences formatter) read as its name, never imported."""


_SiteLoader.add_multi_constructor("tag:yaml.org,2002:python/name:", lambda loader, suffix, node: suffix)


def test_the_reference_pages_are_in_the_site() -> None:
    site = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_SiteLoader)  # noqa: S506 - a safe loader, below
    hooks, plugins = site["hooks"], [p if isinstance(p, str) else next(iter(p)) for p in site["plugins"]]
    assert "docs/hooks/reference.py" in hooks and "mkdocstrings" in plugins
    python = site["plugins"][plugins.index("mkdocstrings")]["mkdocstrings"]["handlers"]["python"]["options"]
    assert python["docstring_style"] == "google"
    shown = [re.compile(f[1:]) for f in python["filters"] if f.startswith("!")]
    for cls in WITH_METHODS:
        hidden = [name for name, _ in _methods(cls) if any(f.search(name) for f in shown)]
        assert not hidden, f"{cls.__name__}: the filters hide {hidden}"


def _modules_defining_public_names() -> set[str]:
    found = set()
    for obj in PUBLIC.values():
        module = sys.modules[obj.__module__]
        found.add(Path(inspect.getfile(module)).resolve().relative_to(ROOT).as_posix())
    return found


def test_ruff_checks_the_docstrings_of_every_module_that_defines_a_public_name() -> None:
    lint = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    assert "D" in lint["select"] and lint["pydocstyle"]["convention"] == "google"
    negated = [glob for glob, rules in lint["per-file-ignores"].items() if glob.startswith("!") and "D" in rules]
    assert len(negated) == 1, "one negated glob: D is ignored everywhere but in the files it names"
    prefix, alternatives, suffix = re.fullmatch(r"!(.*)\{(.*)\}(.*)", negated[0]).groups()  # type: ignore[union-attr]
    checked = {f"{prefix}{alternative}{suffix}" for alternative in alternatives.split(",")}
    missing = [path for path in sorted(_modules_defining_public_names()) if not any(fnmatch(path, c) for c in checked)]
    assert not missing, f"modules defining public names that ruff's D rules skip (add them to pyproject.toml): {missing}"


def _hook() -> Any:
    spec = importlib.util.spec_from_file_location("reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_page_shows_the_help_of_patchkit_and_of_each_command() -> None:
    from patchkit.cli import parser

    hook = _hook()
    assert hook.CLI_MARKER in (ROOT / "docs" / "reference" / "cli.md").read_text()
    shown = hook.cli_help()
    commands = dict(hook._commands(parser()))
    assert set(commands) == {"serve", "mcp", "plan", "demo", "bench", "doctor"}
    for title in ["patchkit", *(f"patchkit {name}" for name in commands)]:
        assert f"$ {title} --help\nusage: {title} " in shown, title
    assert "--batch-wait-ms" in shown and "config file (--config deploy.yaml" in shown  # an option's flag; the file's keys


def test_the_metrics_page_lists_every_metric_and_the_pages_name_no_other() -> None:
    from patchkit.server.metrics import catalogue

    hook = _hook()
    assert hook.METRICS_MARKER in (ROOT / "docs" / "reference" / "metrics.md").read_text()
    table = hook.metrics_table()
    names = {name for name, _, _, _ in catalogue()}
    assert all(f"| `{name}` |" in table for name in names)
    histograms = [name for name, kind, _, _ in catalogue() if kind == "histogram"]
    series = names | {f"{name}_{part}" for name in histograms for part in ("bucket", "sum", "count")}
    named = {m for page in (ROOT / "docs").rglob("*.md") for m in re.findall(r"\bpatchkit_[a-z_]+[a-z]", page.read_text())}
    assert named <= series, f"metrics the documentation names that /metrics does not serve: {sorted(named - series)}"


def test_the_config_page_lists_every_option_by_group() -> None:
    hook = _hook()
    assert hook.GROUPS_MARKER in (ROOT / "docs" / "reference" / "config.md").read_text()
    table = hook.groups_table()
    for name, spec in patchkit.config.OPTIONS.items():
        assert f"| `config.{spec.path}` | `{name}` |" in table, name
