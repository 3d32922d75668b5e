"""The package map holds: every import the table of docs/architecture.md allows, no cycle, a module map
that names every module, a `core` that needs nothing of patchkit but the exception tree and the environment,
and modules about one thing (none over MAX_LINES lines).

The rules are written once, as the table between the two marker comments of docs/architecture.md's
"Which way the imports go"; this file parses it, and the module map under "The package map" (its
convention is the comment above it). Imports are read with `ast` from every module, those inside
functions and those under `if TYPE_CHECKING:` included: a type a layer names is a concept it depends on.
A unit is a subpackage (`patchkit.capture`, `patchkit.scheduler.online`, ...) or a top-level module
(`patchkit.errors`, `patchkit.cli`, ...).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "patchkit"
NESTED = ("patchkit.scheduler.offline", "patchkit.scheduler.online")  # units one level deeper
CORE, CORE_MAY = "patchkit.core", frozenset({"patchkit.errors", "patchkit.envs"})  # what core may import of patchkit
MAX_LINES = 450  # a module longer than this holds more than one thing
RULES_DOC = ROOT / "docs" / "architecture.md"
BEGIN, END = "<!-- import rules: read by tests/test_layout.py -->", "<!-- end of import rules -->"
MAP = "<!-- module map: read by tests/test_layout.py"
DESCRIPTION_COLUMN = 25  # where an entry's description starts; a line indented this far goes on with the entry above


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The unit a module belongs to: its nested scheduler half, its subpackage, or itself."""
    for nested in NESTED:
        if module == nested or module.startswith(nested + "."):
            return nested
    return ".".join(module.split(".")[:2])


def _imports(node: ast.AST, module: str) -> Iterator[str]:
    """Every patchkit module `node` imports, at any depth: inside functions and under `if TYPE_CHECKING:` too."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            yield from (alias.name for alias in child.names if alias.name.split(".")[0] == "patchkit")
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:  # relative: from the module's own package upwards
                package = module.split(".")[: -child.level]
                base = ".".join([*package, base] if base else package)
            if base.split(".")[0] == "patchkit":
                for alias in child.names:  # `from patchkit import capture` imports a module, not a name
                    candidate = f"{base}.{alias.name}"
                    yield candidate if _exists(candidate) else base
        yield from _imports(child, module)


def _exists(module: str) -> bool:
    path = ROOT.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def unit_graph() -> dict[str, set[str]]:
    """Unit -> the units it imports. The top-level `patchkit/__init__.py` (the public face) is left out."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module == "patchkit":
            continue
        unit = unit_of(module)
        edges = graph.setdefault(unit, set())
        for imported in _imports(ast.parse(path.read_text(), str(path)), module):
            if imported == "patchkit":
                continue
            target = unit_of(imported)
            if target != unit:
                edges.add(target)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(unit: str) -> list[str] | None:
        state[unit] = 1
        stack.append(unit)
        for nxt in sorted(graph.get(unit, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[unit] = 2
        return None

    for unit in sorted(graph):
        if unit not in state and (found := visit(unit)):
            return found
    return None


@dataclass(frozen=True)
class Rule:
    """One row of the table: a unit, whether it is a leaf, what it may import and what never."""

    unit: str
    leaf: bool
    may: frozenset[str]
    never: frozenset[str]


def _names(cell: str) -> frozenset[str]:
    return frozenset(re.findall(r"`(patchkit(?:\.\w+)*)`", cell))


def read_rules(text: str) -> dict[str, Rule]:
    """The rows of the table between BEGIN and END: unit | kind | may import | never."""
    if BEGIN not in text or END not in text:
        raise AssertionError(f"{RULES_DOC} lost its import table: keep the lines {BEGIN!r} and {END!r} around it")
    rows = [line for line in text.split(BEGIN, 1)[1].split(END, 1)[0].splitlines() if line.startswith("|")]
    rules = {}
    for row in rows[2:]:  # the header and the line under it
        cells = [cell.strip() for cell in row.strip().strip("|").split("|")]
        if len(cells) != 4 or len(_names(cells[0])) != 1:
            raise AssertionError(f"a row of the import table needs `unit` | kind | may import | never; got {row!r}")
        [unit] = _names(cells[0])
        rules[unit] = Rule(unit, cells[1] == "leaf", _names(cells[2]), _names(cells[3]))
    return rules


def _within(module: str, names: frozenset[str]) -> bool:
    return any(module == name or module.startswith(name + ".") for name in names)


def broken_rules(unit: str, rules: dict[str, Rule]) -> list[str]:
    """Every import of a module of `unit` (type-only ones too) that its row does not allow, as "module imports other"."""
    rule, leaves = rules[unit], frozenset(u for u, r in rules.items() if r.leaf)
    broken = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        if module == "patchkit" or unit_of(module) != unit:
            continue
        for imported in sorted(set(_imports(ast.parse(path.read_text(), str(path)), module))):
            target = unit_of(imported)
            if imported == "patchkit" or target == unit:
                continue
            allowed = target in leaves if rule.leaf else target in leaves or _within(imported, rule.may)
            if not allowed or _within(imported, rule.never):
                broken.append(f"{module} imports {imported}")
    return broken


GRAPH = unit_graph()
RULES = read_rules(RULES_DOC.read_text())


def test_the_graph_sees_the_units() -> None:
    assert {"patchkit.capture", "patchkit.client", "patchkit.core", "patchkit.scheduler.online",
            "patchkit.serving"} <= set(GRAPH)
    assert "patchkit.capture" in GRAPH["patchkit.client"]  # a known edge: the reader finds imports at all


def test_no_import_cycle_between_packages() -> None:
    cycle = _cycle(GRAPH)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_type_only_and_function_local_imports_count() -> None:
    code = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from patchkit.serving.frontend import Frontend
def build() -> None:
    from patchkit.config import backends
"""
    found = set(_imports(ast.parse(code), "patchkit.orchestrator.x"))
    assert found == {"patchkit.serving.frontend", "patchkit.config.backends"}
    graph = {**GRAPH, "patchkit.orchestrator": GRAPH["patchkit.orchestrator"] | {"patchkit.serving"}}
    assert _cycle(graph) is not None  # serving drives the orchestrator: a type it names from above closes a loop


def core_imports() -> list[str]:
    """Every import of patchkit from a module of `core` but of itself, the exception tree and the environment."""
    outside = []
    for path in sorted((PACKAGE / "core").rglob("*.py")):
        module = _module_name(path)
        for imported in sorted(set(_imports(ast.parse(path.read_text(), str(path)), module))):
            if imported != "patchkit" and unit_of(imported) not in {CORE, *CORE_MAY}:
                outside.append(f"{module} imports {imported}")
    return outside


def test_core_imports_nothing_of_patchkit_but_errors_and_envs() -> None:
    outside = core_imports()
    assert not outside, "core holds Component, make, the call hook and the spec, and needs nothing else: " + "; ".join(outside)


def modules_over(limit: int) -> dict[str, int]:
    """Every module of patchkit/ longer than `limit` lines, by its path under the repository, with its length."""
    lengths = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    return {path: lines for path, lines in sorted(lengths.items()) if lines > limit}


def test_no_module_is_over_the_limit() -> None:
    over = modules_over(MAX_LINES)
    assert not over, f"cut these along their concerns (at most {MAX_LINES} lines each): {over}"


def test_every_unit_has_a_row_in_the_table() -> None:
    missing = sorted(set(GRAPH) - set(RULES))
    assert not missing, f"place {missing} in the import table of {RULES_DOC.relative_to(ROOT)}: what may each import?"


def test_what_a_row_forbids_is_a_module_that_exists() -> None:
    """A misspelt "never" would forbid nothing; a misspelt "may import" only forbids more, and fails."""
    unknown = sorted(name for rule in RULES.values() for name in rule.never if name not in RULES and not _exists(name))
    assert not unknown, unknown


@pytest.mark.parametrize("leaf", sorted(u for u, rule in RULES.items() if rule.leaf))
def test_leaves_import_only_leaves(leaf: str) -> None:
    assert not RULES[leaf].may, f"{leaf} is a leaf: it may import only leaves"
    broken = broken_rules(leaf, RULES)
    assert not broken, "; ".join(broken)


@pytest.mark.parametrize("unit", sorted(u for u, rule in RULES.items() if not rule.leaf))
def test_imports_follow_the_table(unit: str) -> None:
    assert not RULES[unit].may & RULES[unit].never, f"{unit}: a name both allowed and forbidden"
    broken = broken_rules(unit, RULES)
    assert not broken, f"not allowed by the import table of {RULES_DOC.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_table_parses_and_the_check_finds_an_import_it_does_not_allow() -> None:
    row = f"{BEGIN}\n| unit | kind | may | never |\n|-|-|-|-|\n| `patchkit.x` | leaf | | the `patchkit.y` module |\n{END}"
    assert read_rules(row) == {"patchkit.x": Rule("patchkit.x", True, frozenset(), frozenset({"patchkit.y"}))}
    serving = RULES["patchkit.serving"]
    stricter = {**RULES, serving.unit: Rule(serving.unit, False, serving.may, serving.never | {"patchkit.orchestrator.backend"})}
    assert any(b.endswith(" imports patchkit.orchestrator.backend") for b in broken_rules(serving.unit, stricter))
    client = RULES["patchkit.client"]
    narrower = {**RULES, client.unit: Rule(client.unit, False, client.may - {"patchkit.capture"}, client.never)}
    assert any(" imports patchkit.capture" in b for b in broken_rules(client.unit, narrower))


def read_module_map(text: str) -> set[str]:
    """The modules and packages the map in the first fenced block after MAP names, as dotted names.

    An entry's line opens with `name/` (a package) or `name.py` (a module), indented two spaces per level under
    the package above it; its `name.py` words, and those of the lines that go on with it, are modules of the
    package the entry opens or sits in. Entries outside `patchkit/` are not read."""
    if MAP not in text:
        raise AssertionError(f"{RULES_DOC} lost its module map: keep the comment starting {MAP!r} above it")
    block = text.split(MAP, 1)[1].split("```", 2)[1]
    named: set[str] = set()
    packages: list[str] = []  # the packages the current line sits in, outermost first
    for line in block.splitlines()[1:]:  # the rest of the opening fence's line
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        first = line.split()[0]
        if indent < DESCRIPTION_COLUMN:  # an entry
            if indent % 2 or indent // 2 > len(packages) or not re.fullmatch(r"\w+/|\w+\.py", first):
                raise AssertionError(f"a line of the module map needs `name/` or `name.py` two spaces deeper than "
                                     f"the package it sits in, or a description from column {DESCRIPTION_COLUMN}; "
                                     f"got {line!r}")
            packages = packages[: indent // 2] + ([first[:-1]] if first.endswith("/") else [])
        if not packages or packages[0] != "patchkit":
            continue
        package = ".".join(packages)
        named.add(package)
        for module in re.findall(r"(?<![\w./])(\w+)\.py\b", line):
            named.add(package if module == "__init__" else f"{package}.{module}")
    return named


def package_modules() -> set[str]:
    """Every module and package under patchkit/, as dotted names."""
    return {_module_name(path) for path in PACKAGE.rglob("*.py")}


MODULE_MAP = read_module_map(RULES_DOC.read_text())


def test_the_module_map_names_every_module() -> None:
    missing = sorted(package_modules() - MODULE_MAP)
    assert not missing, f"name {missing} in the module map of {RULES_DOC.relative_to(ROOT)}: what does each hold?"


def test_the_module_map_names_only_modules_that_exist() -> None:
    unknown = sorted(MODULE_MAP - package_modules())
    assert not unknown, f"the module map of {RULES_DOC.relative_to(ROOT)} names {unknown}, which are not modules"


def test_the_module_map_reads_entries_and_the_lines_that_go_on_with_them() -> None:
    sample = "\n".join([
        f"{MAP} (the convention) -->",
        "```",
        "patchkit/",
        "  __init__.py            the public names",
        "  errors.py  envs.py     leaves",
        "  core/                  the leaf: base.py (Component), as a path `serving/runner.py` is not read,",
        "                         calls.py (the hook)",
        "  scheduler/",
        "    offline/             plan.py",
        "      pwl.py             the fit",
        "    online/",
        "  cli.py                 the command",
        "examples/  tests/        not.py of patchkit",
        "```",
        "```",
        "patchkit/",
        "  later.py               a second block is not the map",
        "```",
    ])
    assert read_module_map(sample) == {
        "patchkit", "patchkit.errors", "patchkit.envs", "patchkit.core", "patchkit.core.base", "patchkit.core.calls",
        "patchkit.scheduler", "patchkit.scheduler.offline", "patchkit.scheduler.offline.plan",
        "patchkit.scheduler.offline.pwl", "patchkit.scheduler.online", "patchkit.cli"}
    with pytest.raises(AssertionError, match="two spaces deeper"):
        read_module_map(f"{MAP} -->\n```\npatchkit/\n      deep.py\n```\n")
