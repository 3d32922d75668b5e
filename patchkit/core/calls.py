"""A `@make` call on its way: where in the user's code it is made, and the hook it goes through.

`BoundMake.__call__` hands every call made while a hook is installed to that hook, with its call site:
capture's recorder keys graph nodes by it, the front-end decides by it which call streams the output
and which starts a prefetch. Installed per context (thread, task or greenlet), so each request's
greenlet has its own.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from patchkit.core.component import Component
    from patchkit.core.make import MakeMethod

__all__ = ["Call", "CallHook", "CallSite", "DeferredSites", "active_call_hook", "call_hook", "deferring", "site_of"]

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class CallSite:
    """Where in the user's source a component method is called: the key of a graph node.

    `deferred`: the call is made by code rewritten for parallel calls (`capture/parallel.py`), which takes a
    `Pending` and waits where the result is first used (`DeferredSites`); not part of the key."""

    filename: str
    lineno: int
    col: int
    end_col: int
    deferred: bool = field(default=False, compare=False)


# Per code object, by identity (hashing a code object reads all of it), the positions of its instructions
# and the sites made from them, made when first asked for; an entry goes with its code (a weak reference).
_SITES: dict[int, tuple[weakref.ref[types.CodeType], list[Any], dict[int, CallSite | None]]] = {}


class DeferredSites:
    """The call instructions of a parallel program whose calls are deferred, per code object of it (the
    program's own, held here with the marks): made by the program, active while it runs (`deferring`)."""

    def __init__(self, marks: Iterable[tuple[types.CodeType, Iterable[int]]]) -> None:
        self._marks = {id(code): (code, frozenset(indexes)) for code, indexes in marks}
        self._sites: dict[CallSite, CallSite] = {}

    def site(self, code: types.CodeType, index: int, site: CallSite) -> CallSite:
        """`site`, marked deferred when the instruction at `index` of `code` is one of the program's."""
        found = self._marks.get(id(code))
        if found is None or found[0] is not code or index not in found[1]:
            return site
        deferred = self._sites.get(site)
        if deferred is None:
            deferred = self._sites[site] = CallSite(site.filename, site.lineno, site.col, site.end_col, True)
        return deferred


_DEFERRING: ContextVar[DeferredSites | None] = ContextVar("patchkit_deferring", default=None)


@contextlib.contextmanager
def deferring(sites: DeferredSites) -> Iterator[None]:
    """Give the calls `sites` marks `deferred=True` sites while the code in this context runs (a parallel
    program's run, in its request's greenlet)."""
    token = _DEFERRING.set(sites)
    try:
        yield
    finally:
        _DEFERRING.reset(token)


def site_of(frame: types.FrameType) -> CallSite | None:
    """The call site of the instruction `frame` is executing (a CALL), from the code's positions.

    Called for every `@make` call made under a hook, so it is a lookup once the code is known."""
    code = frame.f_code
    key = id(code)
    known = _SITES.get(key)
    if known is None or known[0]() is not code:
        known = _SITES[key] = (weakref.ref(code, lambda _: _SITES.pop(key, None)), list(code.co_positions()), {})
    _, positions, sites = known
    index = frame.f_lasti // 2
    if index not in sites:
        sites[index] = _site(code.co_filename, positions[index]) if index < len(positions) else None
    site = sites[index]
    marks = _DEFERRING.get()
    return site if marks is None or site is None else marks.site(code, index, site)


def _site(filename: str, position: tuple[int | None, int | None, int | None, int | None]) -> CallSite | None:
    line, _, col, end_col = position
    return None if line is None else CallSite(filename, line, col or 0, end_col or 0)


class CallHook(Protocol):
    """Receives every `@make` call made while it is installed (see `call_hook`), with its call site
    (None where the code has no positions).

    Capture installs one that records calls and runs them locally; the front-end installs one that
    sends each call to its component's batching queue; a worker one that sends its component's calls
    of the components it holds to their deployment.
    """

    def __call__(
        self, component: Component, method: MakeMethod, args: tuple[Any, ...], kwargs: dict[str, Any], site: CallSite | None
    ) -> Any: ...


_CALL_HOOK: ContextVar[CallHook | None] = ContextVar("patchkit_call_hook", default=None)


def active_call_hook() -> CallHook | None:
    """The hook `@make` calls made here go through, or None when they run in place."""
    return _CALL_HOOK.get()


@contextlib.contextmanager
def call_hook(hook: CallHook | None) -> Iterator[None]:
    """Route `@make` calls made in this context (thread, task or greenlet) through `hook`."""
    token = _CALL_HOOK.set(hook)
    try:
        yield
    finally:
        _CALL_HOOK.reset(token)
