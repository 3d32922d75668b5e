"""The package map holds: no import cycle between packages, and the one-way rules of the design.

Imports are read with `ast` from every module, those inside functions included; only the ones under
`if TYPE_CHECKING:` are left out, since they never run. A unit is a subpackage (`patchkit.capture`,
`patchkit.scheduler.online`, ...) or a top-level module (`patchkit.errors`, `patchkit.config`, ...).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "patchkit"
NESTED = ("patchkit.scheduler.offline", "patchkit.scheduler.online")  # units one level deeper


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str:
    """The unit a module belongs to: its nested scheduler half, its subpackage, or itself."""
    for nested in NESTED:
        if module == nested or module.startswith(nested + "."):
            return nested
    return ".".join(module.split(".")[:2])


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, module: str) -> Iterator[str]:
    """Every patchkit module `node` imports at run time, at any depth."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:
                yield from _imports(other, module)
            continue
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


GRAPH = unit_graph()


def test_the_graph_sees_the_units() -> None:
    assert {"patchkit.capture", "patchkit.client", "patchkit.component", "patchkit.scheduler.online"} <= set(GRAPH)
    assert "patchkit.capture" in GRAPH["patchkit.client"]  # a known edge: the reader finds imports at all


def test_no_import_cycle_between_packages() -> None:
    cycle = _cycle(GRAPH)
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("leaf", ["patchkit.errors", "patchkit.component", "patchkit.envs", "patchkit.telemetry"])
def test_leaves_import_only_leaves(leaf: str) -> None:
    assert GRAPH[leaf] <= {"patchkit.errors"}, GRAPH[leaf]


@pytest.mark.parametrize(
    ("unit", "never"),
    [
        ("patchkit.capture", ("patchkit.scheduler", "patchkit.orchestrator", "patchkit.client", "patchkit.server")),
        ("patchkit.components", ("patchkit.scheduler", "patchkit.orchestrator", "patchkit.client", "patchkit.server")),
        ("patchkit.orchestrator", ("patchkit.scheduler", "patchkit.client", "patchkit.server", "patchkit.config")),
        ("patchkit.scheduler.offline", ("patchkit.scheduler.online", "patchkit.server", "patchkit.client")),
        ("patchkit.scheduler.online", ("patchkit.server", "patchkit.client")),
    ],
)
def test_one_way_imports(unit: str, never: tuple[str, ...]) -> None:
    bad = sorted(target for target in GRAPH[unit] if target.startswith(never))
    assert not bad, f"{unit} imports {bad}"


def test_online_reads_only_the_plan_of_offline() -> None:
    offline = set()
    for path in (PACKAGE / "scheduler" / "online").rglob("*.py"):
        module = _module_name(path)
        offline |= {m for m in _imports(ast.parse(path.read_text()), module) if m.startswith("patchkit.scheduler.offline")}
    assert offline <= {"patchkit.scheduler.offline.plan"}, offline
