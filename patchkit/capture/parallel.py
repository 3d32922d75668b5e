"""The parallel program: a captured body with the waits `overlap.py` finds written into it.

`rewrite` runs the overlap pass over the block (and over each 3.11 list comprehension's own code, which
it rewrites too), places each wait before its instruction (ahead of a call's KW_NAMES and PRECALL),
and `parallel_program` assembles the result into a `Program` that knows its deferred call instructions
(`Program.deferred_sites`), and fills the graph's overlap groups. The waits call the runtime's functions
(`capture/pending.py`), which the code holds as constants: nothing is added to the user's namespace.
Called once per block and calls found, by `client/capture.py`.
"""

from __future__ import annotations

import dis
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from bytecode import Bytecode, Instr

from patchkit.capture.assemble import Program, assemble
from patchkit.capture.compat import CALL_OPS, PY312, PY313
from patchkit.capture.graph import Graph
from patchkit.capture.ir import CapturedBlock
from patchkit.capture.overlap import OverlapPass
from patchkit.capture.overlap_state import (
    COMPREHENSION,
    EMPTY,
    OUTER,
    Actions,
    Guard,
    SiteNode,
    State,
    is_comprehension,
    reads_of,
)
from patchkit.capture.pending import RUNTIME
from patchkit.core import CallSite, make_methods

__all__ = ["ParallelBody", "call_indexes", "parallel_program", "rewrite"]

_LOAD_OF = {"STORE_FAST": "LOAD_FAST_CHECK" if PY312 else "LOAD_FAST", "STORE_NAME": "LOAD_NAME",
            "STORE_DEREF": "LOAD_DEREF"}
_SPLIT = {"LOAD_FAST_LOAD_FAST": ("LOAD_FAST", "LOAD_FAST"), "STORE_FAST_LOAD_FAST": ("STORE_FAST", "LOAD_FAST"),
          "STORE_FAST_STORE_FAST": ("STORE_FAST", "STORE_FAST")}


@dataclass(frozen=True)
class ParallelBody:
    """The rewritten body, and what the program made from it needs: the deferred call instructions (by
    identity, in its body and in the comprehensions' code it holds) and the graph's overlap groups."""

    block: CapturedBlock
    deferred: frozenset[int]  # id() of the deferred CALL instructions of `block.body`
    comprehensions: dict[int, tuple[types.CodeType, tuple[int, ...]]]  # id(new code) -> (code, deferred indexes)
    groups: list[tuple[str, ...]]


# -- emitting ------------------------------------------------------------------------------------------


def _load(fn: str, location: Any) -> Instr:
    """Load one of the runtime's functions: a constant of the code, so that nothing is added to the
    namespace the user's code runs in (their module's globals)."""
    return Instr("LOAD_CONST", RUNTIME[fn], location=location)


def _call(fn: str, args: list[Instr], location: Any) -> list[Instr]:
    """Call the runtime's `fn` with the values `args` push; its result is left on the stack."""
    n = len(args)
    head = [_load(fn, location), Instr("PUSH_NULL", location=location)]
    if not PY313:
        head.reverse()
    tail = [Instr("CALL", n, location=location)]
    if not PY312:
        tail.insert(0, Instr("PRECALL", n, location=location))
    return head + args + tail


def _on_top(fn: str, location: Any) -> list[Instr]:
    """Replace the top of the stack by `fn(top)`, slipping the callable (and NULL) under it."""
    if PY313:
        pre = [_load(fn, location), Instr("SWAP", 2, location=location),
               Instr("PUSH_NULL", location=location), Instr("SWAP", 2, location=location)]
    else:
        pre = [Instr("PUSH_NULL", location=location), Instr("SWAP", 2, location=location),
               _load(fn, location), Instr("SWAP", 2, location=location)]
    tail = [Instr("CALL", 1, location=location)]
    if not PY312:
        tail.insert(0, Instr("PRECALL", 1, location=location))
    return pre + tail


def _check(guard: Guard, location: Any) -> list[Instr]:
    """`guard(kind, *operands, *extra)` (as the kind's own function), the operands copied from the stack,
    which is left as it was."""
    # After the callable, its NULL and j copies, an operand first at depth d is at d + 2 + j.
    copies = [Instr("COPY", d + 2 + j, location=location) for j, d in enumerate(guard.depths)]
    args = [*copies, *(Instr("LOAD_CONST", x, location=location) for x in guard.extra)]
    return _call(f"guard:{guard.kind}", args, location) + [Instr("POP_TOP", location=location)]


def _emit(p: OverlapPass, acts: Actions, location: Any) -> list[Instr]:
    """The instructions of one element's waits, in the order they must run."""
    out: list[Instr] = []
    if acts.settle:
        out += _call("settle", [], location) + [Instr("POP_TOP", location=location)]
    if acts.resolve_top:
        out += _on_top("resolve", location)
    for var in acts.resolve:
        store = p.store_ops[var]
        load = Instr(_LOAD_OF[store.name], store.arg, location=location)
        out += _call("resolve", [load], location) + [Instr(store.name, store.arg, location=location)]
    if acts.iterate_top:
        out += _on_top("iterable", location)
    if acts.guard is not None:
        out += _check(acts.guard, location)
    return out


def _place(out: list[Any], e: Any, waits: list[Instr]) -> None:
    """Append `waits` then `e` to `out`; before a call, the waits go ahead of its KW_NAMES and PRECALL,
    which must stay next to it."""
    at = len(out)
    if isinstance(e, Instr) and e.name in CALL_OPS:
        while at and isinstance(out[at - 1], Instr) and out[at - 1].name in ("KW_NAMES", "PRECALL"):
            at -= 1
    out[at:at] = waits
    out.append(e)


def _split(body: Iterable[Any]) -> list[Any]:
    """3.13's two-variable instructions as two, so that a wait can go between them."""
    out: list[Any] = []
    for e in body:
        if isinstance(e, Instr) and e.name in _SPLIT:
            first, second = _SPLIT[e.name]
            out += [Instr(first, e.arg[0], location=e.location), Instr(second, e.arg[1], location=e.location)]
        else:
            out.append(e)
    return out


# -- the whole body ------------------------------------------------------------------------------------


def rewrite(
    block: CapturedBlock, graph: Graph, params: Iterable[str], output: str | None, module_globals: Mapping[str, Any]
) -> ParallelBody:
    """The captured `block` rewritten for parallel calls, with the graph's overlap groups."""
    site_node = _site_nodes(block.filename, graph)
    body = _split(block.body)
    nested = frozenset().union(*(_closure_reads(e.arg) for e in body if isinstance(e, Instr)
                                 and isinstance(e.arg, types.CodeType)))
    entry = State(EMPTY, frozenset(params), EMPTY, ())
    shadowed = frozenset(module_globals).union(params)
    p = OverlapPass(body, site_node, entry, output, nested, shadowed, comprehensions=True)
    states, actions = p.run()
    comprehensions: dict[int, tuple[types.CodeType, tuple[int, ...]]] = {}
    new_body: list[Any] = []
    deferred: set[int] = set()
    pairs = set(p.pairs)
    for i, e in enumerate(body):
        waits = _emit(p, actions[i], getattr(e, "location", None))
        if isinstance(e, Instr) and is_comprehension(e.arg):
            outer_open = p.comprehension_open.get(id(e.arg), EMPTY)
            code, indexes, inner_pairs = _comprehension(e.arg, site_node, outer_open, shadowed)
            comprehensions[id(code)] = (code, indexes)
            pairs |= inner_pairs
            e = Instr(e.name, code, location=e.location)
        elif isinstance(e, Instr) and e.name in CALL_OPS and states[i] is not None and p.kind(i) == "deferred":
            deferred.add(id(e))
        _place(new_body, e, waits)
    groups = _groups({pair for pair in pairs if COMPREHENSION not in pair})
    return ParallelBody(replace(block, body=tuple(new_body)), frozenset(deferred), comprehensions, groups)


def _closure_reads(code: types.CodeType) -> frozenset[str]:
    """The block's variables that code made from `code` may read later, when it is called: a 3.11 list
    comprehension runs at once, but a lambda or generator made inside it is code like any other."""
    if not is_comprehension(code):
        return reads_of(code)
    return frozenset().union(*(_closure_reads(c) for c in code.co_consts if isinstance(c, types.CodeType)))


def _comprehension(
    code: types.CodeType, site_node: SiteNode, outer_open: frozenset[str], shadowed: frozenset[str]
) -> tuple[types.CodeType, tuple[int, ...], set[tuple[str, str]]]:
    """A 3.11 list comprehension's own code rewritten: its calls overlap with each other and with the
    enclosing code's open calls; it settles before returning its list."""
    bc = Bytecode.from_code(code)
    body = list(bc)
    entry = State(EMPTY, frozenset(code.co_varnames[: code.co_argcount]), outer_open | {OUTER}, ())
    p = OverlapPass(body, site_node, entry, None, EMPTY, shadowed, comprehensions=False)
    states, actions = p.run()
    new_body: list[Any] = []
    deferred: list[Instr] = []
    for i, e in enumerate(body):
        if isinstance(e, Instr) and e.name in CALL_OPS and states[i] is not None and p.kind(i) == "deferred":
            deferred.append(e)
        _place(new_body, e, _emit(p, actions[i], getattr(e, "location", None)))
    bc.clear()
    bc.extend(new_body)
    new = bc.to_code()
    return new, call_indexes(new, new_body, {id(e) for e in deferred}), set(p.pairs)


def call_indexes(code: types.CodeType, body: Iterable[Any], deferred: set[int]) -> tuple[int, ...]:
    """The code-unit indexes (offset // 2) in `code`, assembled from `body`, of the calls in `deferred`:
    the n-th call instruction of the body is the n-th of the code."""
    marks = [id(e) in deferred for e in body if isinstance(e, Instr) and e.name in CALL_OPS]
    offsets = [i.offset for i in dis.get_instructions(code) if i.opname in CALL_OPS]
    if len(marks) != len(offsets):
        raise AssertionError(f"{len(marks)} calls in the body, {len(offsets)} in its code")
    return tuple(offset // 2 for offset, mark in zip(offsets, marks) if mark)


def _site_nodes(filename: str, graph: Graph) -> SiteNode:
    """For a call instruction: its graph node and whether it keeps its place (its method is not
    `read_only=True`, or is `ordered=True`); None when the graph has no component call there."""
    components = graph.components()

    def lookup(e: Instr) -> tuple[str, bool] | None:
        if not isinstance(e, Instr) or e.name not in CALL_OPS or e.lineno is None:
            return None
        loc = e.location
        site = CallSite(filename, e.lineno, (loc.col_offset or 0) if loc else 0, (loc.end_col_offset or 0) if loc else 0)
        node = graph.node_at(site)
        if node is None:
            return None
        method = make_methods(type(components[node.component])).get(node.method)
        return node.id, method is None or method.ordered or not method.read_only

    return lookup


def _groups(pairs: set[tuple[str, str]]) -> list[tuple[str, ...]]:
    """Connected components of the overlap pairs, each in node order; a call paired with itself alone is a group."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in pairs:
        parent[find(a)] = find(b)
    members: dict[str, list[str]] = {}
    for x in sorted(parent, key=_node_order):
        members.setdefault(find(x), []).append(x)
    return sorted((tuple(m) for m in members.values()), key=lambda g: _node_order(g[0]))


def _node_order(node_id: str) -> tuple[int, str]:
    digits = node_id.lstrip("n")
    return (int(digits), node_id) if digits.isdigit() else (1 << 30, node_id)


def parallel_program(
    block: CapturedBlock, graph: Graph, params: tuple[str, ...], output: str | None, module_globals: Mapping[str, Any]
) -> Program | None:
    """The program a deployment runs with parallel calls, and `graph.overlap_groups` filled; None when
    no call of the block can be deferred (the program would be the block's own)."""
    rewritten = rewrite(block, graph, params, output, module_globals)
    if not rewritten.deferred and not any(indexes for _, indexes in rewritten.comprehensions.values()):
        return None
    program = assemble(rewritten.block, params, output, module_globals)
    top = call_indexes(program.code, rewritten.block.body, set(rewritten.deferred))
    deferred: list[tuple[tuple[int, ...], tuple[int, ...]]] = [((), top)]
    for k, const in enumerate(program.code.co_consts):
        if isinstance(const, types.CodeType) and id(const) in rewritten.comprehensions:
            deferred.append(((k,), rewritten.comprehensions[id(const)][1]))
    graph.overlap_groups = rewritten.groups
    return replace(program, deferred=tuple((path, idx) for path, idx in deferred if idx))
