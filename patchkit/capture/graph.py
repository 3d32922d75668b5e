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
    """One component call site of the pipeline code: `graph.nodes[id]`.

    Attributes:
        id: its id in the graph (and in `GET /v1/graph`).
        component: the component's name in the pipeline (the variable it was bound to).
        cls: the component's class name.
        method: the `@make` method called.
        site: where the call is in the source (its file and line).
        guards: the conditions that decide whether it runs.
        loops: the ids of the loops that repeat it, outermost first.
        visits: how many times the eager runs made it.
    """

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
        """`component.method`, as the pictures write it."""
        return f"{self.component}.{self.method}"


@dataclass(frozen=True)
class Edge:
    """A dependency between two nodes (or an input and a node, or a node and `"output"`).

    Attributes:
        src: the node (or input name) it comes from.
        dst: the node (or `"output"`) it goes to.
        kind: `"data"` (dst reads what src returned) or `"control"` (src decides whether dst runs).
        label: the variable that carries the data, where there is one.
    """

    src: str
    dst: str
    kind: Literal["data", "control"]
    label: str = ""


class Graph:
    """A captured pipeline's calls and their dependencies: `pipeline.graph`, also served as `GET /v1/graph`.

    It renders itself in Jupyter (as SVG); `to_svg()`, `to_mermaid()` and `to_dot()` draw it elsewhere.

        for group in pipeline.graph.overlap_groups:  # calls a request may have in flight together
            print([pipeline.graph.nodes[node].label for node in group])

    Built at capture from the block's bytecode; each eager run (`pipeline(...)`, the capture's own) adds its
    visits.

    Attributes:
        inputs: the pipeline's input names.
        nodes: each call site by node id (`Node`: its component, method, source line, guards and loops).
        edges: the data and control dependencies (`Edge`), inputs and `"output"` included.
        loops: each loop that repeats calls, by id.
        runs: how many eager runs the visit counts come from.
        overlap_groups: the calls a request may have in flight at once when deployed (calls of methods
            declared `@make(read_only=True)`): each group is the node ids of one stretch of the pipeline code,
            in the order the code reaches them; a group of one node is a call that overlaps itself (issued in
            a loop before its first result is needed). Empty where no call may overlap.
    """

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
        # A dict output's fields, each with the call nodes whose result it is (dict displays with string keys).
        self.output_fields: dict[str, frozenset[str]] = {}
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
        """Add a dependency, once (called by the data-flow pass at capture)."""
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
        """Name the components passed to named components' constructors (the generator a Grader is given).

        Called after the bound ones have their names, so a pipeline's `llm` keeps its own; each is then a
        component of the pipeline, deployed once and called by its holders there.
        """
        todo = list(self._named.values())
        while todo:
            holder_name, holder = todo.pop(0)
            for label, inner in constructor_components(holder):
                if self.name_of(inner) is None:
                    todo.append((self.name_component(inner, f"{holder_name}_{label}"), inner))

    def name_of(self, component: Component) -> str | None:
        """The component's name in the pipeline, if it has one."""
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
        """The call sites whose result is the output as it is, or an item of it (a field of a dict output).

        A streaming call there streams the output.
        """
        sources = {e.src for e in self.edges if e.dst == OUTPUT and e.label == PART}
        return frozenset(self.nodes[n].site for n in sources if n in self.nodes)

    def set_output_fields(self, pairs: Iterable[tuple[str, str]]) -> None:
        """Record which output-part calls make which field of a dict output (called by the data-flow pass)."""
        fields: dict[str, set[str]] = {}
        for key, node in pairs:
            fields.setdefault(key, set()).add(node)
        self.output_fields = {key: frozenset(nodes) for key, nodes in sorted(fields.items())}

    def field_sites(self, field: str | None) -> frozenset[CallSite]:
        """The call sites whose result is the output (`field` None), or field `field` of a dict output.

        The call that answers a request asking for that field (the one its stream follows and its options reach).
        """
        if field is None or not self.output_fields:
            return self.output_sites()
        return frozenset(self.nodes[n].site for n in self.output_fields.get(field, ()) if n in self.nodes)

    def site_fields(self) -> dict[CallSite, str]:
        """The field of a dict output each call site makes, where the graph knows one."""
        return {self.nodes[n].site: key for key, nodes in self.output_fields.items() for n in nodes if n in self.nodes}

    def components(self) -> dict[str, Component]:
        """The pipeline's components by name."""
        return dict(self._named.values())

    # -- views ----------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        """Plain data, as `GET /v1/graph` serves it.

        Nodes with their source place, visits and overlap group (an index into `overlap_groups`, or None),
        edges, loops, and the overlap groups as lists of node ids.
        """
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
        """The graph in Graphviz's dot language."""
        return render.to_dot(self)

    def to_mermaid(self) -> str:
        """The graph as a Mermaid flowchart (for a Markdown page that renders Mermaid)."""
        return render.to_mermaid(self)

    def to_svg(self) -> str:
        """The graph drawn as SVG, by patchkit itself (no Graphviz needed): what Jupyter shows."""
        return render.to_svg(self)

    def _repr_svg_(self) -> str:
        return self.to_svg()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, str]:
        return {"image/svg+xml": self.to_svg(), "text/plain": repr(self)}

    def __repr__(self) -> str:
        calls = ", ".join(n.label for n in self.nodes.values())
        return f"<Graph {len(self.nodes)} calls ({calls}), {len(self.edges)} edges, {len(self.loops)} loops>"
