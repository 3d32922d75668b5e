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
    from patchkit.component.base import Component, MakeMethod

__all__ = ["Call", "CallHook", "CallSite", "active_call_hook", "call_hook", "defer_calls", "site_of"]

Call = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class CallSite:
    """Where in the user's source a component method is called: the key of a graph node.

    `deferred`: the call is made by code rewritten for parallel calls (`capture/parallel.py`), which takes a
    `Pending` and waits where the result is first used; not part of the key."""

    filename: str
    lineno: int
    col: int
    end_col: int
    deferred: bool = field(default=False, compare=False)


# Per code object, by identity (hashing a code object reads all of it), the site of each instruction,
# made when first asked for. The code is held with its sites (so its id is not reused meanwhile): the
# pipelines' and components' code, a few; past MAX_CODES (code made at run time) they are forgotten.
_SITES: dict[int, tuple[types.CodeType, list[Any], dict[int, CallSite | None]]] = {}
MAX_CODES = 4096
# The instructions (indexes of code units) of rewritten pipeline code whose calls are deferred, by code
# identity, for as long as the code lives.
_DEFERRED: dict[int, tuple[weakref.ref[types.CodeType], frozenset[int]]] = {}


def defer_calls(code: types.CodeType, indexes: Iterable[int]) -> None:
    """Mark the calls at `indexes` (instruction offset // 2) of `code` as deferred: `site_of` gives their
    sites `deferred=True`. Called when a parallel pipeline program is made or unpickled."""
    key = id(code)
    _DEFERRED[key] = (weakref.ref(code, lambda _: _DEFERRED.pop(key, None)), frozenset(indexes))
    _SITES.pop(key, None)


def site_of(frame: types.FrameType) -> CallSite | None:
    """The call site of the instruction `frame` is executing (a CALL), from the code's positions.

    Called for every `@make` call made under a hook, so it is a lookup once the code is known."""
    code = frame.f_code
    known = _SITES.get(id(code))
    if known is None or known[0] is not code:
        if len(_SITES) >= MAX_CODES:
            _SITES.clear()
        known = _SITES[id(code)] = (code, list(code.co_positions()), {})
    _, positions, sites = known
    index = frame.f_lasti // 2
    if index not in sites:
        deferred = _DEFERRED.get(id(code))
        defer = deferred is not None and deferred[0]() is code and index in deferred[1]
        sites[index] = _site(code.co_filename, positions[index], defer) if index < len(positions) else None
    return sites[index]


def _site(
    filename: str, position: tuple[int | None, int | None, int | None, int | None], deferred: bool
) -> CallSite | None:
    line, _, col, end_col = position
    return None if line is None else CallSite(filename, line, col or 0, end_col or 0, deferred)


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
