"""A layered layout of a directed graph of boxes, for the SVG pictures `render.py` draws.

The Sugiyama method, in pure Python and deterministic (no random choice, no set order):

1. Cycles: the back edges of a depth-first search (a loop's way back) are laid out reversed.
2. Ranks: each box's rank is its longest path from a box nothing points to, so a box sits below every
   box it depends on and parallel branches share a rank, side by side. Between two ranks of boxes lies a
   rank of edge labels.
3. Virtual points: an edge is cut into one point per rank it crosses, so a long edge goes through the
   gaps between the boxes of the ranks it passes, never through a box; an edge's label is one of those
   points, as wide as the label, so no box and no other label can take its place.
4. Order: barycentre sweeps, down and up, each rank sorted by the mean place of its neighbours in the
   rank before; the order with the fewest crossings wins.
5. Places: each rank's points are pulled towards their neighbours' mean x (a weighted isotonic
   regression keeps their order and spacing), a few sweeps down and up.

Every box lies inside its rank's band and every edge runs straight between bands or vertically through
a band at its own point, so an edge meets a box only at its own ends. An edge from a box to itself is a
loop on the box's right side, in room its rank keeps free.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["LABEL_H", "Layout", "layered"]

LABEL_H = 14.0  # the height of an edge label's band
_MARGIN, _GAP_BOX, _GAP_POINT, _GAP_BAND = 20.0, 28.0, 10.0, 20.0
_LOOP_OUT = 18.0  # how far a self-loop reaches right of its box
_SWEEPS, _PLACE_SWEEPS = 12, 24


@dataclass
class Layout:
    """Where everything goes: the top-left corner of each box, each edge's points (from its source to its
    destination), each label's rectangle (x, y, width, height; None for an edge with no label)."""

    boxes: dict[str, tuple[float, float]]
    routes: list[list[tuple[float, float]]]
    labels: list[tuple[float, float, float, float] | None]
    width: float
    height: float


@dataclass
class _Point:
    """One place in a rank: a box, or a virtual point of an edge (with its label's width, if it carries it)."""

    key: str
    rank: int
    left: float
    right: float
    box: bool
    x: float = 0.0
    ins: list[str] = field(default_factory=list)
    outs: list[str] = field(default_factory=list)


def _back_edges(ids: list[str], edges: list[tuple[str, str]]) -> set[tuple[str, str]]:
    """The edges that close a cycle in a depth-first search from the boxes in their given order."""
    out: dict[str, list[str]] = {i: [] for i in ids}
    for src, dst in edges:
        if src != dst and dst not in out[src]:
            out[src].append(dst)
    back: set[tuple[str, str]] = set()
    state: dict[str, int] = {}
    for root in ids:
        if root in state:
            continue
        state[root] = 1
        stack = [(root, iter(out[root]))]
        while stack:
            node, successors = stack[-1]
            nxt = next(successors, None)
            if nxt is None:
                state[node] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                back.add((node, nxt))
            elif nxt not in state:
                state[nxt] = 1
                stack.append((nxt, iter(out[nxt])))
    return back


def _ranks(ids: list[str], down: list[tuple[str, str]]) -> dict[str, int]:
    """Longest path from a source, over the edges pointing down (an acyclic graph)."""
    rank = dict.fromkeys(ids, 0)
    indegree = dict.fromkeys(ids, 0)
    for _, dst in down:
        indegree[dst] += 1
    ready = [i for i in ids if indegree[i] == 0]
    while ready:
        node = ready.pop(0)
        for src, dst in down:
            if src == node:
                rank[dst] = max(rank[dst], rank[node] + 1)
                indegree[dst] -= 1
                if indegree[dst] == 0:
                    ready.append(dst)
    return rank


def _crossings(upper: list[_Point], lower: list[_Point], where: dict[str, int]) -> int:
    pairs = sorted((where[p.key], where[o]) for p in upper for o in p.outs)
    return sum(1 for i, (_, b) in enumerate(pairs) for _, d in pairs[i + 1 :] if d < b)


def _order(rows: list[list[_Point]], points: dict[str, _Point]) -> list[list[_Point]]:
    """Barycentre sweeps down and up; the order with the fewest crossings."""

    def where_of(layout: list[list[_Point]]) -> dict[str, int]:
        return {p.key: i for row in layout for i, p in enumerate(row)}

    def total(layout: list[list[_Point]]) -> int:
        where = where_of(layout)
        return sum(_crossings(a, b, where) for a, b in zip(layout, layout[1:]))

    best, best_count = [list(r) for r in rows], total(rows)
    current = [list(r) for r in rows]
    for sweep in range(_SWEEPS):
        downward = sweep % 2 == 0
        sequence = range(1, len(current)) if downward else range(len(current) - 2, -1, -1)
        for r in sequence:
            where = where_of(current)
            keyed = [(_centre(p.ins if downward else p.outs, where, k), k, p) for k, p in enumerate(current[r])]
            current[r] = [p for _, _, p in sorted(keyed, key=lambda t: (t[0], t[1]))]
        count = total(current)
        if count < best_count:
            best, best_count = [list(r) for r in current], count
    return best


def _centre(near: list[str], where: dict[str, int], own: int) -> float:
    """The barycentre of a point's neighbours' places; its own place when it has none there."""
    return sum(where[n] for n in near) / len(near) if near else float(own)


def _isotonic(desired: list[float], weights: list[float], gaps: list[float]) -> list[float]:
    """x minimising the weighted squared distance to `desired`, with x[i+1] - x[i] >= gaps[i]."""
    offsets = [0.0]
    for gap in gaps:
        offsets.append(offsets[-1] + gap)
    blocks: list[list[float]] = []  # [mean, weight, count]
    for d, w, off in zip(desired, weights, offsets):
        blocks.append([d - off, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    values = [m for m, _, c in blocks for _ in range(int(c))]
    return [v + off for v, off in zip(values, offsets)]


def _place(rows: list[list[_Point]], points: dict[str, _Point]) -> None:
    """x of every point: packed, then pulled towards its neighbours' mean, keeping order and spacing."""

    def gaps(row: list[_Point]) -> list[float]:
        return [a.right + b.left + (_GAP_BOX if a.box and b.box else _GAP_POINT) for a, b in zip(row, row[1:])]

    for row in rows:
        x = 0.0
        for k, p in enumerate(row):
            x += gaps(row)[k - 1] if k else 0.0
            p.x = x
    for sweep in range(_PLACE_SWEEPS):
        downward = sweep % 2 == 0
        sequence = range(1, len(rows)) if downward else range(len(rows) - 2, -1, -1)
        for r in sequence:
            row = rows[r]
            desired: list[float] = []
            for k, p in enumerate(row):
                near = (p.ins if downward else p.outs) or (p.outs if downward else p.ins)
                if near:
                    desired.append(sum(points[n].x for n in near) / len(near))
                else:  # a box joined to nothing stays beside the box before it
                    desired.append(desired[-1] + gaps(row)[k - 1] if k else p.x)
            weights = [1.0 if p.box else 4.0 for p in row]  # long edges straight first
            for p, x in zip(row, _isotonic(desired, weights, gaps(row))):
                p.x = x
    left = min((p.x - p.left for row in rows for p in row), default=0.0)
    for row in rows:
        for p in row:
            p.x += _MARGIN - left


def layered(sizes: dict[str, tuple[float, float]], edges: list[tuple[str, str, float]]) -> Layout:
    """Lay out boxes (`sizes`: width and height by id, in a stable order) and edges (source, destination,
    the width of its label or 0) in ranks, top to bottom."""
    ids = list(sizes)
    back = _back_edges(ids, [(s, d) for s, d, _ in edges])
    down = [((d, s) if (s, d) in back else (s, d)) for s, d, _ in edges]
    rank = _ranks(ids, [e for e in down if e[0] != e[1]])
    points: dict[str, _Point] = {}
    loop_room: dict[str, float] = {}
    for (s, d), (_, _, label_w) in zip(down, edges):
        if s == d:
            loop_room[s] = max(loop_room.get(s, 0.0), _LOOP_OUT + (label_w + 6 if label_w else 0.0))
    for i in ids:
        w = sizes[i][0]
        points[i] = _Point(i, 2 * rank[i], w / 2, w / 2 + loop_room.get(i, 0.0), True)
    chains: list[list[str]] = []
    for k, ((s, d), (_, _, label_w)) in enumerate(zip(down, edges)):
        if s == d:
            chains.append([s])
            continue
        chain = [s]
        for r in range(2 * rank[s] + 1, 2 * rank[d]):
            key = f"\0{k}:{r}"
            carries = bool(label_w) and r == 2 * rank[s] + 1
            points[key] = _Point(key, r, 3.0, 3.0 + (label_w + 4 if carries else 0.0), False)
            chain.append(key)
        chain.append(d)
        for a, b in zip(chain, chain[1:]):
            points[a].outs.append(b)
            points[b].ins.append(a)
        chains.append(chain)
    top = max((p.rank for p in points.values()), default=0)
    rows: list[list[_Point]] = [[] for _ in range(top + 1)]
    for key in points:  # boxes in their given order, then each edge's points in edge order
        rows[points[key].rank].append(points[key])
    rows = [[p for p in row if p.ins or p.outs] + [p for p in row if not (p.ins or p.outs)] for row in _order(rows, points)]
    _place(rows, points)
    bands = _bands(rows, sizes)
    return _routes(points, chains, down, edges, sizes, bands, back)


def _bands(rows: list[list[_Point]], sizes: dict[str, tuple[float, float]]) -> list[tuple[float, float]]:
    """(top, bottom) of each rank: a box rank as tall as its tallest box, a label rank as a label if it has one."""
    bands = []
    y = _MARGIN
    for r, row in enumerate(rows):
        if r % 2 == 0:
            height = max((sizes[p.key][1] for p in row if p.box), default=0.0)
        else:
            height = LABEL_H if any(p.right > 3.0 for p in row) else 0.0
        bands.append((y, y + height))
        y += height + _GAP_BAND
    return bands


def _routes(
    points: dict[str, _Point],
    chains: list[list[str]],
    down: list[tuple[str, str]],
    edges: list[tuple[str, str, float]],
    sizes: dict[str, tuple[float, float]],
    bands: list[tuple[float, float]],
    back: set[tuple[str, str]],
) -> Layout:
    boxes = {i: (points[i].x - sizes[i][0] / 2, bands[points[i].rank][0]) for i in sizes}
    ports = _ports(points, chains, sizes, boxes)
    routes: list[list[tuple[float, float]]] = []
    labels: list[tuple[float, float, float, float] | None] = []
    for k, (chain, (s, d), (src, dst, label_w)) in enumerate(zip(chains, down, edges)):
        if len(chain) == 1:  # a loop on the box's right side
            x, y = boxes[s]
            w, h = sizes[s]
            right = x + w
            y1, y2 = y + h * 0.3, y + h * 0.7
            routes.append([(right, y1), (right + _LOOP_OUT, y1), (right + _LOOP_OUT, y2), (right, y2)])
            labels.append((right + _LOOP_OUT + 4, y + h / 2 - LABEL_H / 2, label_w, LABEL_H) if label_w else None)
            continue
        route = [ports[(k, "out")]]
        band_bottom = bands[points[s].rank][1]
        if route[0][1] < band_bottom:  # a box lower than its rank: straight down out of the rank first
            route.append((route[0][0], band_bottom))
        label = None
        for key in chain[1:-1]:
            p = points[key]
            band_top, band_bottom = bands[p.rank]
            route.append((p.x, band_top))
            if band_bottom > band_top:
                route.append((p.x, band_bottom))
            if p.right > 3.0:
                label = (p.x + 5, band_top, label_w, LABEL_H)
        route.append(ports[(k, "in")])
        routes.append(route[::-1] if (src, dst) != (s, d) else route)
        labels.append(label)
    width = max((p.x + p.right for p in points.values()), default=0.0) + _MARGIN
    height = (bands[-1][1] if bands else 0.0) + _MARGIN
    return Layout(boxes, routes, labels, width, height)


def _ports(
    points: dict[str, _Point],
    chains: list[list[str]],
    sizes: dict[str, tuple[float, float]],
    boxes: dict[str, tuple[float, float]],
) -> dict[tuple[int, str], tuple[float, float]]:
    """Where each edge leaves its upper box (bottom side) and enters its lower one (top side): spread along the
    side in the order of the points they go to, so edges fan out instead of starting on one spot."""
    ends: dict[tuple[str, str], list[tuple[float, int]]] = {}
    for k, chain in enumerate(chains):
        if len(chain) > 1:
            ends.setdefault((chain[0], "out"), []).append((points[chain[1]].x, k))
            ends.setdefault((chain[-1], "in"), []).append((points[chain[-2]].x, k))
    ports: dict[tuple[int, str], tuple[float, float]] = {}
    for (node, side), group in ends.items():
        w, h = sizes[node]
        p = points[node]
        group.sort()
        step = min(12.0, w * 0.5 / max(len(group), 1))
        for j, (_, k) in enumerate(group):
            dx = (j - (len(group) - 1) / 2) * step
            ports[(k, side)] = (p.x + dx, boxes[node][1] + (h if side == "out" else 0.0))
    return ports
