"""Paths through a captured graph: which calls can follow which, and how many calls a request
still has ahead of it. The online SLO estimators read them (`scheduler/online/averages.py`,
`xgb.py`); they are written over plain successor maps, so a map learned from finished traces
(`scheduler/online/traces.py`) works as well as the graph's own.

A successor map sends each node to the nodes that can come right after it. Its nodes are the call
nodes, the request's start (`START`) and `OUTPUT`; an end is a node with nothing after it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping

from patchkit.capture.graph import OUTPUT, Graph

__all__ = ["START", "CallsLeft", "calls_left", "next_calls", "strongly_connected", "successor_map"]

START = "input:"  # the request's start: the prefix of the graph's input nodes
CallsLeft = dict[str | None, tuple[int, int]]
"""Per position (a node; None before the first call): the fewest and the most calls still to come."""


def successor_map(graph: Graph) -> tuple[dict[str, set[str]], set[str], dict[str, list[str]]]:
    """The graph's successor map, its call nodes, and the node ids of each `component.method` label."""
    calls = {n for e in graph.edges for n in (e.src, e.dst) if n != OUTPUT and not n.startswith(START)}
    calls |= set(graph.nodes)
    successors: dict[str, set[str]] = {START: set()}
    for edge in graph.edges:
        if edge.src in calls and edge.dst != edge.src:
            successors.setdefault(edge.src, set()).add(edge.dst)
    successors[START] = _first_calls(graph, successors, calls)
    labels: dict[str, list[str]] = {}
    for node in graph.nodes.values():
        labels.setdefault(node.label, []).append(node.id)
    return successors, calls, labels


def calls_left(
    successors: Mapping[str, set[str]], calls: set[str], labels: Mapping[str, list[str]] | None = None
) -> CallsLeft:
    """Per position, the fewest and the most calls still to come on the way to an end.

    Along a path each node counts once, and a loop is counted once: the most is the longest path
    over the loops collapsed to single steps, each step worth the calls it holds. With `labels`,
    a label is a position too (a label on several nodes gets the fewest and the most of all of them).
    """
    fewest = _fewest_calls(successors, calls)
    most = _most_calls(successors, calls)
    found: CallsLeft = {node: (fewest[node], most[node]) for node in calls}
    found[None] = (fewest[START], most[START])
    for label, ids in (labels or {}).items():
        if label not in found:
            found[label] = (min(fewest[i] for i in ids), max(most[i] for i in ids))
    return found


def _first_calls(graph: Graph, successors: Mapping[str, set[str]], calls: set[str]) -> set[str]:
    """The calls a request can start with: each call that no other call feeds and, of each loop
    that no call outside it feeds, the calls an input feeds (all of the loop's, if none)."""
    among_calls = {src: after & calls for src, after in successors.items() if src in calls}
    first: set[str] = set()
    for component in strongly_connected(among_calls, calls):
        members = set(component)
        if any(after & members for src, after in among_calls.items() if src not in members):
            continue
        fed = {e.dst for e in graph.edges if e.src.startswith(START) and e.dst in members}
        first |= fed if len(members) > 1 and fed else members
    return first


def next_calls(graph: Graph) -> dict[str, set[str]]:
    """Per node id and label (and `START`), the calls that can come right after it, or OUTPUT."""
    successors, _, labels = successor_map(graph)
    following = {node: set(after) for node, after in successors.items()}
    for label, ids in labels.items():
        following.setdefault(label, set()).update(*(successors.get(i, set()) for i in ids))
    return following


def _fewest_calls(successors: Mapping[str, set[str]], calls: set[str]) -> dict[str, int]:
    """Shortest paths, in calls, to an end: Dijkstra from the ends backwards."""
    nodes = set(successors) | {n for after in successors.values() for n in after} | calls
    predecessors: dict[str, list[str]] = {n: [] for n in nodes}
    for src, after in successors.items():
        for dst in after:
            predecessors[dst].append(src)
    ends = [n for n in nodes if not successors.get(n)]
    # A loop with no way out (a `while True:` whose exit the graph misses) ends wherever it stops.
    ends += [n for component in strongly_connected(successors, nodes) if _closed(component, successors) for n in component]
    fewest = dict.fromkeys(nodes, math.inf)
    heap = [(0, n) for n in ends]
    for n in ends:
        fewest[n] = 0
    while heap:
        distance, node = heapq.heappop(heap)
        if distance > fewest[node]:
            continue
        step = distance + (node in calls)
        for src in predecessors[node]:
            if step < fewest[src]:
                fewest[src] = step
                heapq.heappush(heap, (step, src))
    return {n: int(d) for n, d in fewest.items()}


def _closed(component: list[str], successors: Mapping[str, set[str]]) -> bool:
    members = set(component)
    return len(component) > 1 and all(successors.get(n, set()) <= members for n in component)


def _most_calls(successors: Mapping[str, set[str]], calls: set[str]) -> dict[str, int]:
    """Longest paths, in calls, to an end, each loop (strongly connected component) one step worth
    its calls; the node's own call is not counted."""
    nodes = set(successors) | {n for after in successors.values() for n in after} | calls
    most: dict[str, int] = {}
    after_component: dict[int, int] = {}
    of: dict[str, int] = {}
    for index, component in enumerate(strongly_connected(successors, nodes)):  # ends first
        for node in component:
            of[node] = index
        worth = sum(node in calls for node in component)
        downstream = {of[dst] for node in component for dst in successors.get(node, ()) if of[dst] != index}
        after_component[index] = max((after_component[d] for d in downstream), default=0)
        for node in component:
            most[node] = worth - (node in calls) + after_component[index]
        after_component[index] += worth
    return most


def strongly_connected(successors: Mapping[str, set[str]], nodes: set[str]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively, in reverse topological order (a
    component comes after every component it leads to)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(nodes):
        if root in index:
            continue
        work = [(root, iter(sorted(successors.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, pending = work[-1]
            for dst in pending:
                if dst not in index:
                    index[dst] = low[dst] = len(index)
                    stack.append(dst)
                    on_stack.add(dst)
                    work.append((dst, iter(sorted(successors.get(dst, ())))))
                    break
                if dst in on_stack:
                    low[node] = min(low[node], index[dst])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(component)
    return found
