"""The pipeline graph: component call sites, their data and control dependencies, and loops.

Nodes are call sites of `@make` methods (a component, a method, a place in the source); the
special nodes `input:<name>` and `output` stand for the pipeline's inputs and its result. Data
edges say a call's arguments derive from another call's result or an input; control edges say a
condition derived from a call's result decides whether a call runs. Loops name the calls they
repeat. Visit counts per node accumulate from eager runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from patchkit.capture import render
from patchkit.capture.holders import constructor_components
from patchkit.capture.recorder import CallRecord
from patchkit.core import CallSite, Component

__all__ = ["OUTPUT", "PART", "Edge", "Graph", "Guard", "Loop", "Node"]

OUTPUT = "output"
PART = "part"  # the label of a data edge into OUTPUT from a call whose result the output is, or holds as an item


@dataclass(frozen=True)
class Loop:
    """A loop that repeats calls: `kind` is "for", "while" or "comprehension"."""

    id: str
    kind: str
    filename: str
    lineno: int


@dataclass(frozen=True)
class Guard:
    """A condition deciding whether a call runs: `kind` is "if", "for", "while" or "except"."""

    kind: str
    lineno: int
    sources: frozenset[str]


@dataclass
class Node:
    id: str
    component: str
    cls: str
    method: str
    site: CallSite
    guards: list[Guard] = field(default_factory=list)
    loops: list[str] = field(default_factory=list)
    visits: int = 0

    @property
    def label(self) -> str:
        return f"{self.component}.{self.method}"


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    kind: Literal["data", "control"]
    label: str = ""


class Graph:
    """Built by `dataflow.build_graph` at capture; `count_run` adds the visits of each eager run."""

    def __init__(self, inputs: Iterable[str]) -> None:
        self.inputs = list(inputs)
        self.nodes: dict[str, Node] = {}
        self.edges: list[Edge] = []
        self.loops: dict[str, Loop] = {}
        self.runs = 0
        # Calls a request may have in flight at once (deployed with parallel calls): each group is the node
        # ids of one window of the pipeline code, in the order the code reaches them; a group of one node
        # is a call that overlaps with itself (issued in a loop before the first result is needed).
        self.overlap_groups: list[tuple[str, ...]] = []
        self._by_site: dict[CallSite, str] = {}
        self._named: dict[str, tuple[str, Component]] = {}  # uid -> (name, component)

    # -- building -------------------------------------------------------------------------------
    def node_for(self, site: CallSite, name: str, component: Component, method: str) -> Node:
        """The node of a call site, added on first sight (statically, or by an eager run)."""
        node_id = self._by_site.get(site)
        if node_id is None:
            node_id = f"n{len(self.nodes)}"
            self._by_site[site] = node_id
            name = self.name_component(component, name)
            self.nodes[node_id] = Node(node_id, name, type(component).__name__, method, site)
        return self.nodes[node_id]

    def node_at(self, site: CallSite) -> Node | None:
        """The node of a call site, if the graph has one."""
        node_id = self._by_site.get(site)
        return None if node_id is None else self.nodes[node_id]

    def add_edge(self, src: str, dst: str, kind: Literal["data", "control"], label: str = "") -> None:
        edge = Edge(src, dst, kind, label)
        if src != dst or kind == "data":
            if edge not in self.edges:
                self.edges.append(edge)

    def name_component(self, component: Component, name: str) -> str:
        """Give `component` its display name (the first one wins); returns the name it has."""
        uid = component._patchkit_spec.uid
        if uid not in self._named:
            taken = {n for n, _ in self._named.values()}
            unique, k = name, 2
            while unique in taken:
                unique, k = f"{name}_{k}", k + 1
            self._named[uid] = (unique, component)
        return self._named[uid][0]

    def name_held(self) -> None:
        """Name the components passed to named components' constructors (the generator a Grader is
        given), after the bound ones have their names, so a pipeline's `llm` keeps its own; each is
        then a component of the pipeline, deployed once and called by its holders there."""
        todo = list(self._named.values())
        while todo:
            holder_name, holder = todo.pop(0)
            for label, inner in constructor_components(holder):
                if self.name_of(inner) is None:
                    todo.append((self.name_component(inner, f"{holder_name}_{label}"), inner))

    def name_of(self, component: Component) -> str | None:
        named = self._named.get(component._patchkit_spec.uid)
        return named[0] if named else None

    # -- eager runs -----------------------------------------------------------------------------
    def count_run(self, calls: Iterable[CallRecord]) -> None:
        """Add one run's calls to the visit counts; a call site not seen statically becomes a node."""
        self.runs += 1
        for call in calls:
            if call.site is None:
                continue
            name = self.name_of(call.component) or type(call.component).__name__.lower()
            self.node_for(call.site, name, call.component, call.method).visits += 1

    def visits_per_run(self) -> dict[str, float]:
        """Expected calls per request of each node, from the eager runs so far."""
        return {n.id: (n.visits / self.runs if self.runs else 0.0) for n in self.nodes.values()}

    def output_sites(self) -> frozenset[CallSite]:
        """The call sites whose result is the output as it is, or an item of it (a field of a dict output):
        a streaming call there streams the output."""
        sources = {e.src for e in self.edges if e.dst == OUTPUT and e.label == PART}
        return frozenset(self.nodes[n].site for n in sources if n in self.nodes)

    def components(self) -> dict[str, Component]:
        return dict(self._named.values())

    # -- views ----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """Plain data for `GET /v1/graph`: nodes with their source place, visits and overlap group (an
        index into `overlap_groups`, or None), edges, loops, and the overlap groups as lists of node ids."""
        overlap = {node_id: i for i, group in enumerate(self.overlap_groups) for node_id in group}
        nodes = [
            {
                "id": n.id,
                "component": n.component,
                "class": n.cls,
                "method": n.method,
                "file": n.site.filename,
                "line": n.site.lineno,
                "loops": n.loops,
                "guards": [{"kind": g.kind, "line": g.lineno, "sources": sorted(g.sources)} for g in n.guards],
                "visits_per_run": n.visits / self.runs if self.runs else None,
                "overlap_group": overlap.get(n.id),
            }
            for n in self.nodes.values()
        ]
        edges = [{"src": e.src, "dst": e.dst, "kind": e.kind, "label": e.label} for e in self.edges]
        loops = [{"id": loop.id, "kind": loop.kind, "line": loop.lineno} for loop in self.loops.values()]
        return {
            "inputs": self.inputs,
            "nodes": nodes,
            "edges": edges,
            "loops": loops,
            "runs": self.runs,
            "overlap_groups": [list(group) for group in self.overlap_groups],
        }

    def to_dot(self) -> str:
        return render.to_dot(self)

    def to_mermaid(self) -> str:
        return render.to_mermaid(self)

    def to_svg(self) -> str:
        return render.to_svg(self)

    def _repr_svg_(self) -> str:
        return self.to_svg()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"image/svg+xml": self.to_svg(), "text/plain": repr(self)}

    def __repr__(self) -> str:
        calls = ", ".join(n.label for n in self.nodes.values())
        return f"<Graph {len(self.nodes)} calls ({calls}), {len(self.edges)} edges, {len(self.loops)} loops>"
