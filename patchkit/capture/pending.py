"""A request's component calls in flight: submitted where the pipeline code reaches them, waited for where
their results are first needed (parallel calls).

The front-end runs a rewritten copy of the pipeline's code (`capture/parallel.py`). At a deferred call site
the call hook submits the call and hands back a `Pending`; the rewritten code keeps it in the variable (or
the comprehension's list) the result goes to, and calls `resolve` on that variable before its first use,
`settle` before any code with effects, `guard` before local work that may run user code (which settles
unless it runs none on the values at hand), and `iterable` on what a loop iterates. A `Pending` lives only
there, between a call and the first use of its result: user code never sees one, so `isinstance`,
identity, `json` and C extensions see the result itself.

The request's `Window` keeps its open calls in the order the code issued them, so a failure surfaces as
plain Python raises it: the earliest failing call's own exception, even when a later call finished first.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypeVar

from patchkit.capture.guards import CHECKS, Memo, ids

__all__ = ["RUNTIME", "Pending", "Window", "guard", "iterable", "resolve", "run_in_window", "settle"]

T = TypeVar("T")


class Pending:
    """One submitted call: `wait()` blocks the request's code until its result is back (and returns it or
    raises its error); `cancel()` withdraws it. Made by the call hook through `Window.add`."""

    __slots__ = ("cancel", "done", "ok", "result", "seq", "wait", "window")

    def __init__(self, window: Window, seq: int, wait: Callable[[], Any], cancel: Callable[[], Any]) -> None:
        self.window, self.seq, self.wait, self.cancel = window, seq, wait, cancel
        self.done = self.ok = False
        self.result: Any = None

    def outcome(self) -> None:
        """Wait for the call once; its result or its error (an Exception) is kept. A BaseException
        (the request cancelled or timed out) goes straight through: it is the request's end, not the call's."""
        if self.done:
            return
        try:
            self.result, self.ok = self.wait(), True
        except Exception as exc:
            self.result = exc
        self.done = True


class Window:
    """The calls one request has issued and its code has not waited for yet, in issue order.

    Used from the request's greenlet only (the hook adds, the rewritten code takes and settles) and by
    the runner when the request ends (`failure`, `abandon`)."""

    def __init__(self) -> None:
        self._open: dict[Pending, None] = {}  # an ordered set: issue order
        self._seq = itertools.count()
        self._raised: BaseException | None = None
        # The guards' verdicts on containers, kept between two waits: until the request's code waits, only
        # its own guarded code runs, which changes no container without settling first.
        self.memo: Memo = {}

    def add(self, wait: Callable[[], Any], cancel: Callable[[], Any]) -> Pending:
        pending = Pending(self, next(self._seq), wait, cancel)
        self._open[pending] = None
        return pending

    def take(self, pending: Pending) -> Any:
        """The result of `pending` once it is back; its error is raised unless a call issued before it
        failed too, whose error plain Python would have raised first."""
        pending.outcome()
        self._open.pop(pending, None)
        if pending.ok:
            return pending.result
        raise self._mark(self._earliest_before(pending.seq) or pending.result)

    def settle(self) -> None:
        """Wait for every open call, in issue order; raise the first one's error that failed."""
        self.memo.clear()
        for pending in list(self._open):
            pending.outcome()
            if not pending.ok:
                raise self._mark(pending.result)
        self._open.clear()

    def failure(self, error: BaseException) -> BaseException:
        """What a request that raised `error` fails with: the error of the earliest open call that failed
        (issued before whatever raised, so plain Python would have stopped there), else `error` itself."""
        if error is self._raised or not isinstance(error, Exception):
            return error
        return self._earliest_before(None) or error

    def abandon(self) -> None:
        """The request ended: withdraw the calls it never waited for; their results are dropped."""
        self.memo.clear()
        for pending in self._open:
            if not pending.done:
                pending.cancel()
        self._open.clear()

    def __bool__(self) -> bool:
        return bool(self._open)

    def __len__(self) -> int:
        """How many calls are open."""
        return len(self._open)

    def _earliest_before(self, seq: int | None) -> BaseException | None:
        for pending in list(self._open):
            if seq is not None and pending.seq >= seq:
                break
            pending.outcome()
            if not pending.ok:
                return pending.result
        return None

    def _mark(self, error: BaseException) -> BaseException:
        self._raised = error
        return error


_WINDOW: ContextVar[Window | None] = ContextVar("patchkit_window", default=None)


def run_in_window(window: Window, code: Callable[[], T]) -> T:
    """Run a request's rewritten code with `window` (called by the front-end's runner, in the request's
    greenlet): an error it raises becomes the earliest failed call's where plain Python would have stopped
    there (`Window.failure`), and the calls it never waited for are withdrawn when it ends."""
    token = _WINDOW.set(window)
    try:
        return code()
    except Exception as exc:
        failure = window.failure(exc)
        if failure is exc:
            raise
        raise failure from None
    finally:
        window.abandon()
        _WINDOW.reset(token)


# -- called from the rewritten pipeline code ------------------------------------------------------------


def resolve(value: Any) -> Any:
    """A variable's value before its first use: a call's result once it is back; a list a comprehension
    filled with calls, its items replaced by their results in place (the list stays the same object)."""
    if type(value) is Pending:
        return value.window.take(value)
    if type(value) is list:
        for i, item in enumerate(value):
            if type(item) is Pending:
                value[i] = item.window.take(item)
    return value


def settle() -> None:
    """Before code with effects: wait for every open call of the request, raising the earliest error."""
    window = _WINDOW.get()
    if window:
        window.settle()


def guard(kind: str, *operands: Any) -> None:
    """Before local work that may run user code on its operands (an operator, a truth test, a format, an
    attribute read, a builtin's call): settle the open calls unless `guards.CHECKS[kind]` finds that it
    runs none on these."""
    window = _WINDOW.get()
    if window is not None and window._open and not CHECKS[kind](window.memo, *operands):
        window.settle()


def _guard_of(kind: str) -> Callable[..., None]:
    """`guard(kind, ...)` as its own function, which the rewritten code calls: one call less per guard, for
    guards stand before every operator of a loop while calls are open."""
    check = CHECKS[kind]

    def guard_kind(*operands: Any) -> None:
        window = _WINDOW.get()
        if window is not None and window._open and not check(window.memo, *operands):
            window.settle()

    guard_kind.__qualname__ = guard_kind.__name__ = f"guard_{kind}"
    return guard_kind


def iterable(value: Any) -> Any:
    """What a loop iterates: itself when iterating it runs no code of the user's (a list, a dict, a range,
    ...); otherwise, once the open calls are settled (`__iter__` may be the user's), an iterator that settles
    them before each step, since a generator's code must not run while a call that plain Python would have
    finished first is still open."""
    if id(type(value)) in _PURE_ITERABLES or _pure_iterator(value):
        return value
    settle()
    return _Settling(iter(value))


_PURE_ITERABLES = ids({list, tuple, range, str, bytes, dict, set, frozenset, type({}.keys()),
                       type({}.values()), type({}.items())})
_SAMPLES: tuple[Any, ...] = ([], (), range(1), range(1 << 70), "", b"", {}, set(), {}.values(), {}.items())
_PURE_ITERATORS = ids({type(iter(x)) for x in _SAMPLES} | {type(reversed([]))})


def _pure_iterator(value: Any) -> bool:
    """An iterator over containers only: a builtin one, or zip/enumerate of such (read from their reduce)."""
    kind = type(value)
    if id(kind) in _PURE_ITERATORS:
        return True
    if kind is zip or kind is enumerate:
        _, args = value.__reduce__()[:2]
        inner = args if kind is zip else args[:1]
        return all(id(type(x)) in _PURE_ITERABLES or _pure_iterator(x) for x in inner)
    return False


class _Settling:
    """The iterator a loop over a generator gets: each step first settles the request's open calls."""

    __slots__ = ("_inner",)

    def __init__(self, inner: Iterator[Any]) -> None:
        self._inner = inner

    def __iter__(self) -> _Settling:
        return self

    def __next__(self) -> Any:
        settle()
        return next(self._inner)


# The functions the rewritten code calls, which it holds as constants (`capture/parallel.py`).
RUNTIME: dict[str, Callable[..., Any]] = {"resolve": resolve, "settle": settle, "iterable": iterable, "guard": guard,
                                          **{f"guard:{kind}": _guard_of(kind) for kind in CHECKS}}
