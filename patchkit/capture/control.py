"""Control structure of one instruction list, for the data-flow pass: control dependence, loops and
`except` regions.

`dataflow.py` builds a `ControlFlow` for every body it interprets (the captured block's, and each
comprehension, lambda or helper it enters) and reads from it, per element, the branches that decide
whether the element runs (`Guard`s of its calls), the loops that repeat it, and the `except`
handlers it lies in. Control dependence comes from post-dominators; loops are the natural loops of
the backward jumps, registered with the graph as they are found.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any

from bytecode import Instr, Label, TryBegin

from patchkit.capture.analysis import reachable, successors
from patchkit.capture.graph import Graph, Loop

__all__ = ["ControlFlow"]


class ControlFlow:
    """Control structure of one instruction list: control dependence, loops, `except` regions.

    Control dependence and loops use normal control flow only: an exception edge would make every
    call after a `try` (or an inlined comprehension's cleanup handler) depend on it.
    """

    def __init__(self, body: tuple[Any, ...], filename: str, comprehension: bool, graph: Graph) -> None:
        self.body = body
        self.succ = successors(body)
        self.label_at = {id(e): i for i, e in enumerate(body) if isinstance(e, Label)}
        self.normal = [
            [j for j in nxt if not isinstance(e, TryBegin) or j == i + 1] for i, (e, nxt) in enumerate(zip(body, self.succ))
        ]
        self.controls = self._control_dependence()
        self.loops = self._loops(filename, comprehension, graph)
        self.excepts = self._except_regions()

    def _control_dependence(self) -> dict[int, set[int]]:
        """For each element, the branch elements that decide whether it runs (transitively)."""
        n = len(self.body)
        pdom: list[frozenset[int]] = [frozenset(range(n + 1))] * n + [frozenset({n})]
        changed = True
        while changed:
            changed = False
            for i in reversed(range(n)):
                new = frozenset({i}) | frozenset.intersection(*(pdom[s] for s in self.normal[i] or [n]))
                if new != pdom[i]:
                    pdom[i] = new
                    changed = True
        controls: dict[int, set[int]] = {}
        for b in range(n):
            if len(set(self.normal[b])) < 2:
                continue
            strict = pdom[b] - {b}
            for s in self.normal[b]:
                for node in pdom[s] - strict:
                    if node < n:
                        controls.setdefault(node, set()).add(b)
        for node in controls:  # a call guarded by an `if` inside a loop is guarded by the loop too
            controls[node] = reachable(controls[node], lambda b: controls.get(b, ()))
        return controls

    def _loops(self, filename: str, comprehension: bool, graph: Graph) -> dict[int, list[str]]:
        """Natural loops of the backward jumps: the elements each loop repeats."""
        preds: dict[int, list[int]] = {}
        for i, nxt in enumerate(self.normal):
            for j in nxt:
                preds.setdefault(j, []).append(i)
        members: dict[int, list[str]] = {}
        for j, e in enumerate(self.body):
            head = self.label_at.get(id(e.arg), j + 1) if isinstance(e, Instr) and e.has_jump() else j + 1
            if head > j:
                continue
            first = next((x for x in self.body[head:] if isinstance(x, Instr)), None)
            kind = "comprehension" if comprehension else ("for" if first is not None and first.name == "FOR_ITER" else "while")
            line = _first_line(self.body, head)
            loop_id = f"loop{line}_{zlib.crc32(filename.encode()) % 10_000}"
            graph.loops.setdefault(loop_id, Loop(loop_id, kind, filename, line))
            for i in _natural_loop(preds, head, j):
                if loop_id not in members.setdefault(i, []):
                    members[i].append(loop_id)
        return members

    def _except_regions(self) -> dict[int, list[int]]:
        """Elements of each `except` handler, reached by normal flow from its entry: i -> lines."""
        regions: dict[int, list[int]] = {}
        for e in self.body:
            if not isinstance(e, TryBegin):
                continue
            start = self.label_at[id(e.target)]
            line = _first_line(self.body, start)
            for i in reachable((start,), lambda k: self.normal[k]):
                if line not in regions.setdefault(i, []):
                    regions[i].append(line)
        return regions

    def guard_kind(self, b: int) -> tuple[str, int]:
        """The kind ("for", "while", "if") and line of the branch element `b`."""
        e = self.body[b]
        assert isinstance(e, Instr)
        if e.name == "FOR_ITER":
            return "for", e.lineno or 0
        backward = self.label_at.get(id(e.arg), b + 1) <= b
        return ("while" if backward else "if"), e.lineno or 0


def _first_line(body: tuple[Any, ...], start: int) -> int:
    for e in body[start:]:
        if isinstance(e, Instr) and e.lineno is not None:
            return e.lineno
    return 0


def _natural_loop(preds: Mapping[int, list[int]], head: int, jump: int) -> set[int]:
    """The elements a backward jump to `head` repeats: those that reach the jump without passing the head."""
    return reachable((head, jump), lambda p: () if p == head else preds.get(p, ()))
