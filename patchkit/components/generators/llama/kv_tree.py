"""`KnowledgeTree`: the KV states of prompt prefixes kept within a byte budget, evicted by PGDSF.

A prompt over documents is a path of pieces: the system prompt (with the chat template's head), then
each document in order. A node holds the KV state its piece adds to its parent's, so the prefix up to
a node is restored from the states along its path; the KV of a token depends on every token before it,
so a document cached after one prefix is of no use after another, and the same document has one node
per path that led to it. Only leaves are evicted: a node's state is useless without its parent's.

Eviction follows RAGCache's prefix-aware Greedy Dual-Size Frequency policy. A node's priority is
`clock + frequency * cost / size`: how often it was used, times what evaluating its tokens again would
cost, per byte it holds; the leaf of lowest priority goes first, and the clock rises to the priority
of each leaf evicted, so nodes not used for a while fall behind new ones (recency) without their
frequency being reset. Pure bookkeeping: the states are opaque, and the caller gives each one's size
and cost.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["KnowledgeTree", "Node"]

State = TypeVar("State")
Piece = tuple[int, ...]


@dataclass(eq=False)
class Node(Generic[State]):
    """One piece of a cached path: its tokens, the KV state it adds (`size` bytes), and where that state
    ends in the prompt (`kept` tokens from position 0, its parent's included)."""

    piece: Piece
    kept: int
    state: State | None
    size: int
    cost: float
    parent: Node[State] | None
    frequency: int = 0
    priority: float = 0.0
    touched: int = 0  # when it was last used: the older goes first between equal priorities
    children: dict[Piece, Node[State]] = field(default_factory=dict)


class KnowledgeTree(Generic[State]):
    """A prefix tree of KV states within `budget` bytes (see the module's docstring). Not thread-safe:
    its owner (an engine) calls it under its own lock."""

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise ValueError(f"the KV cache budget ({budget} bytes) must be >= 0")
        self.budget = budget
        self.root: Node[State] = Node((), 0, None, 0, 0.0, None)
        self.bytes = 0
        self.entries = 0
        self.evictions = 0
        self.clock = 0.0
        self._ticks = itertools.count(1)

    def match(self, pieces: Sequence[Piece]) -> list[Node[State]]:
        """The nodes of the longest cached path along `pieces`, root excluded, shallowest first."""
        path, node = [], self.root
        for piece in pieces:
            child = node.children.get(piece)
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def use(self, path: Sequence[Node[State]]) -> None:
        """Count one more use of every node of `path` (a prompt restored from it) and raise their priorities."""
        for node in path:
            self._touch(node)

    def insert(self, parent: Node[State], piece: Piece, kept: int, state: State, size: int, cost: float) -> Node[State] | None:
        """Add `piece` under `parent` (a node of this tree, the root for a path's first piece), evicting
        leaves of lowest priority until it fits; None, evicting nothing, when it cannot fit the budget
        beside its ancestors. The existing node, unchanged, when `piece` is there already."""
        if (child := parent.children.get(piece)) is not None:
            return child
        ancestors = self._path_to(parent)
        if sum(node.size for node in ancestors) + size > self.budget:
            return None
        while self.bytes + size > self.budget:
            self._evict(self._victim(ancestors))
        node: Node[State] = Node(piece, kept, state, size, cost, parent)
        parent.children[piece] = node
        self.bytes += size
        self.entries += 1
        self._touch(node)
        return node

    def prune(self, node: Node[State]) -> None:
        """Remove `node` if it is a leaf holding no state (a piece too short to hold a whole block), and
        so its ancestors: such a leaf restores nothing its parent does not."""
        while node is not self.root and not node.children and node.size == 0 and node.parent is not None:
            del node.parent.children[node.piece]
            self.entries -= 1
            node = node.parent

    def leaves(self) -> list[Node[State]]:
        """Every node without children."""
        found, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children:
                found.append(node)
        return found

    def _touch(self, node: Node[State]) -> None:
        node.frequency += 1
        node.touched = next(self._ticks)
        node.priority = self.clock + node.frequency * node.cost / max(1, node.size)

    def _path_to(self, node: Node[State]) -> set[Node[State]]:
        ancestors = set()
        while node is not self.root and node.parent is not None:
            ancestors.add(node)
            node = node.parent
        return ancestors

    def _victim(self, kept: set[Node[State]]) -> Node[State]:
        """The leaf holding bytes, outside `kept`, of lowest priority; the least recently used among equals."""
        leaves = [leaf for leaf in self.leaves() if leaf.size and leaf not in kept]
        return min(leaves, key=lambda leaf: (leaf.priority, leaf.touched))

    def _evict(self, leaf: Node[State]) -> None:
        assert leaf.parent is not None
        del leaf.parent.children[leaf.piece]
        self.bytes -= leaf.size
        self.entries -= 1
        self.evictions += 1
        self.clock = max(self.clock, leaf.priority)
        self.prune(leaf.parent)
