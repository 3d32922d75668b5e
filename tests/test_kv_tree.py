"""The document KV cache's parts that need no model: the knowledge tree with its PGDSF eviction, and the
cutting and joining of llama.cpp sequence states."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from patchkit.components.generators.llama.kv_state import MAGIC, StateLayout, StateLayoutError
from patchkit.components.generators.llama.kv_tree import KnowledgeTree, Node


def grow(tree: KnowledgeTree[str], *pieces: tuple[int, ...], size: int = 10, cost: float = 10.0) -> list[Node[str]]:
    """Insert a path of pieces (the ones present are kept), each new one holding `size` bytes."""
    path, node = [], tree.root
    for piece in pieces:
        found = tree.insert(node, piece, 0, "state", size, cost)
        assert found is not None
        path.append(found)
        node = found
    return path


def held(tree: KnowledgeTree[str]) -> set[tuple[tuple[int, ...], ...]]:
    """Every cached path, as its pieces."""
    paths, stack = set(), [(node, (node.piece,)) for node in tree.root.children.values()]
    while stack:
        node, path = stack.pop()
        paths.add(path)
        stack += [(child, (*path, child.piece)) for child in node.children.values()]
    return paths


def test_lookup_finds_the_deepest_cached_prefix_in_order() -> None:
    tree: KnowledgeTree[str] = KnowledgeTree(1000)
    system, a, b, c = (1, 2), (3,), (4, 5), (6,)
    grow(tree, system, a, b)
    grow(tree, system, c)
    assert [n.piece for n in tree.match([system, a, b, c])] == [system, a, b]
    assert [n.piece for n in tree.match([system, a, c])] == [system, a]
    assert [n.piece for n in tree.match([system, b, a])] == [system]  # another order: another prefix
    assert tree.match([(9,), a]) == [] and tree.match([]) == []
    assert tree.entries == 4 and tree.bytes == 40


def test_the_leaf_of_lowest_frequency_times_cost_per_byte_goes_first() -> None:
    tree: KnowledgeTree[str] = KnowledgeTree(100)
    system = grow(tree, (0,), size=10)[0]
    cheap = tree.insert(system, (1,), 0, "s", 30, cost=30.0)  # 1 use x 30 / 30 bytes = 1
    costly = tree.insert(system, (2,), 0, "s", 30, cost=90.0)  # 1 x 90 / 30 = 3
    popular = tree.insert(system, (3,), 0, "s", 30, cost=30.0)  # 1 x 30 / 30, used 3 times more: 4
    assert cheap and costly and popular
    for _ in range(3):
        tree.use([system, popular])
    assert tree.insert(system, (4,), 0, "s", 30, cost=60.0) is not None  # needs room: evicts `cheap`
    assert held(tree) == {((0,),), ((0,), (2,)), ((0,), (3,)), ((0,), (4,))}
    assert tree.evictions == 1 and tree.clock == pytest.approx(1.0)
    # The newcomer's priority counts from the clock: 1 + 1 x 60 / 30 = 3, tied with `costly`; the older goes.
    assert tree.insert(system, (5,), 0, "s", 30, cost=300.0) is not None
    assert held(tree) == {((0,),), ((0,), (3,)), ((0,), (4,)), ((0,), (5,))}
    assert tree.bytes == 100 and tree.entries == 4


def test_only_leaves_are_evicted_and_never_the_ancestors_of_the_newcomer() -> None:
    tree: KnowledgeTree[str] = KnowledgeTree(50)
    grow(tree, (0,), (1,), size=10, cost=1.0)  # a parent of low priority, under a leaf
    hot = grow(tree, (0,), (2,), size=10, cost=1000.0)[1]
    assert tree.insert(hot, (3,), 0, "s", 30, cost=1000.0) is not None  # evicts (1,), its parent stays
    assert held(tree) == {((0,),), ((0,), (2,)), ((0,), (2,), (3,))}
    # Its ancestors hold 20 of the 50 bytes: a 40-byte piece under them cannot fit, and nothing is evicted for it.
    assert tree.insert(hot, (4,), 0, "s", 40, cost=1.0) is None
    assert tree.evictions == 1 and tree.bytes == 50
    # A 30-byte piece fits once every leaf outside its path is gone, however hot.
    assert tree.insert(hot, (5,), 0, "s", 30, cost=1.0) is not None
    assert held(tree) == {((0,),), ((0,), (2,)), ((0,), (2,), (5,))}


def test_a_piece_used_long_ago_falls_behind_new_ones() -> None:
    tree: KnowledgeTree[str] = KnowledgeTree(30)
    system = grow(tree, (0,), size=10)[0]
    old = tree.insert(system, (1,), 0, "s", 10, cost=10.0)
    assert old is not None
    tree.use([old, old])  # used three times, then never again
    evicted_at = None
    for i in range(2, 10):  # one new piece after another, each used once
        assert tree.insert(system, (i,), 0, "s", 10, cost=10.0) is not None
        if evicted_at is None and tree.match([(0,), (1,)])[-1] is not old:
            evicted_at = i
    # The clock rises to each evicted piece's priority; new pieces start from it, so they overtake `old`.
    assert evicted_at == 5


def test_the_byte_budget_holds_through_any_insertions() -> None:
    rng = random.Random(7)
    tree: KnowledgeTree[str] = KnowledgeTree(500)
    for _ in range(400):
        path = [tree.root]
        for depth in range(rng.randint(1, 4)):
            piece = (depth, rng.randint(0, 6))
            found = tree.insert(path[-1], piece, 0, "s", rng.choice([0, 0, 20, 50, 120, 600]), rng.uniform(1, 100))
            if found is None:
                break
            path.append(found)
        tree.use(path[1:])
        tree.prune(path[-1])
        nodes = [n for p in held(tree) for n in [tree.match(list(p))[-1]]]
        assert tree.bytes == sum(n.size for n in nodes) <= 500
        assert tree.entries == len(nodes)
        assert all(n.size or n.children for n in nodes), "a leaf holding nothing is pruned"
    assert tree.evictions > 0


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match=r"budget \(-1 bytes\) must be >= 0"):
        KnowledgeTree(-1)


# -- llama.cpp sequence states --------------------------------------------------------------------------

def sequence_state(cells: int, *, v_trans: bool, magic: bool = True, stream: int = 1, n_stream: int = 3,
                   layers: int = 2) -> bytes:
    """Sequence 1's state in llama.cpp's layout, its cells at positions 0.. in stream `stream`, filled
    with bytes that depend on the layer, the position and the element only (so a prefix's state is the
    state's prefix)."""
    table = np.random.default_rng(0).integers(0, 256, size=(layers, 2, 512, 8), dtype=np.uint8)  # layer, k/v, position
    out = [struct.pack("<Ii", MAGIC, 1)] if magic else []
    out.append(struct.pack("<I", n_stream))
    for s in range(n_stream):
        out.append(struct.pack("<I", cells if s == stream else 0))
        if s != stream:
            continue
        out += [struct.pack("<iIi", pos, 1, 1) for pos in range(cells)]
        out.append(struct.pack("<II", int(v_trans), layers))
        for layer in range(layers):
            out += [struct.pack("<iQ", 1, 8), table[layer, 0, :cells].tobytes()]
        for layer in range(layers):
            if v_trans:  # 4 elements of 2 bytes, each a run over the cells
                rows = table[layer, 1, :cells].reshape(cells, 4, 2).transpose(1, 0, 2)
                out += [struct.pack("<iII", 1, 2, 4), rows.tobytes()]
            else:
                out += [struct.pack("<iQ", 1, 8), table[layer, 1, :cells].tobytes()]
    return b"".join(out)


@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("magic", [False, True])
def test_runs_cut_from_a_state_join_into_the_state_of_their_prefix(v_trans: bool, magic: bool) -> None:
    layout, cells = StateLayout.read(sequence_state(200, v_trans=v_trans, magic=magic), 2)
    runs = [layout.cut(cells, a, b) for a, b in ((0, 64), (64, 64), (64, 192))]
    assert [r.nbytes for r in runs] == [64 * 44, 0, 128 * 44]  # 12 bytes of metadata and 2 x 2 x 8 of data a cell
    joined = layout.join(runs)
    # In the first stream rather than its own: llama.cpp restores a sequence into the stream of its slot either way.
    assert joined == sequence_state(192, v_trans=v_trans, magic=magic, stream=0)
    assert StateLayout.read(joined, 2)[1].end == 192
    with pytest.raises(ValueError, match="follow each other from position 0"):
        layout.join([runs[2]])


def test_a_state_in_another_layout_is_refused() -> None:
    whole = sequence_state(10, v_trans=True)
    with pytest.raises(StateLayoutError, match="not a llama.cpp sequence state"):
        StateLayout.read(whole, 3)  # the model has another number of layers
    with pytest.raises(StateLayoutError, match="not a llama.cpp sequence state"):
        StateLayout.read(whole[:-7], 2)
    with pytest.raises(StateLayoutError, match="consecutive positions in order"):
        swapped = bytearray(whole)
        struct.pack_into("<i", swapped, 16, 5)  # the first cell claims position 5
        StateLayout.read(bytes(swapped), 2)
    with pytest.raises(ValueError, match=r"\[5, 20\) are not within \[0, 10\)"):
        layout, cells = StateLayout.read(whole, 2)
        layout.cut(cells, 5, 20)
