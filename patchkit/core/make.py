"""`@make`: the decorator that marks a `Component`'s steps, and the methods it makes.

`@make` marks the methods a pipeline calls; each call goes through the active `CallHook` when one is
installed (capture records calls, the front-end routes them to workers) and runs locally otherwise.
A `MakeMethod` runs a batch of calls, a call or a stream of chunks: its asynchronous core is written
once, and its synchronous edge runs that core on the component loop (an `async def` method) or right
here, in the calling thread (a plain `def` one, whose core never waits: `event_loop.run_inline`).
"""

from __future__ import annotations

import asyncio
import inspect
import math
import sys
from collections.abc import AsyncGenerator, Callable, Generator, Sequence
from typing import Any, TypeVar, overload

from patchkit.core.calls import Call, CallHook, active_call_hook, call_hook, site_of
from patchkit.core.component import Component, ensure_setup
from patchkit.core.event_loop import component_loop, iterate_inline, run_inline, watched
from patchkit.core.options import OPTIONS_ARGUMENT, CallReport, Chunk, joined
from patchkit.errors import MakeError

__all__ = ["DEFAULT_ASYNC_CONCURRENCY", "DEFAULT_BATCH_SIZE", "BoundMake", "MakeMethod", "make", "make_methods"]

DEFAULT_BATCH_SIZE = 32
# The calls in flight per replica of an `async def` per-item method (a coroutine, or an async generator
# streaming) without `max_concurrency` (or `max_batch_size`, which then says it): they await together on
# the replica's loop, as a Ray Serve replica's async methods do up to its max_ongoing_requests. Say
# `max_concurrency=N` for more (a client of a remote API that takes hundreds at once), or
# `max_concurrency=1` for a method whose calls must not interleave.
DEFAULT_ASYNC_CONCURRENCY = 32
F = TypeVar("F", bound=Callable[..., Any])


class MakeMethod:
    """A `@make` method: a descriptor that knows how to run one call or a batch of calls."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        batch: bool,
        max_batch_size: int | None = None,
        timeout_s: float | None = None,
        retries: int | None = None,
        max_concurrency: int | None = None,
        stream: bool = False,
        ordered: bool = False,
        read_only: bool = False,
    ) -> None:
        _check_target(fn, batch=batch, stream=stream)
        for option, value in (("ordered", ordered), ("read_only", read_only)):
            if not isinstance(value, bool):
                raise MakeError(f"@make on {fn.__qualname__}: {option} must be True or False; got {value!r}")
        if ordered and read_only:
            raise MakeError(
                f"@make on {fn.__qualname__}: ordered=True (a method with effects, kept in its place) and "
                "read_only=True (a method with none) contradict each other; keep the one that is true"
            )
        if max_batch_size is not None and (not _is_int(max_batch_size) or max_batch_size < 1):
            raise MakeError(f"@make on {fn.__qualname__}: max_batch_size must be a positive int; got {max_batch_size!r}")
        if timeout_s is not None and (
            isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf
        ):
            raise MakeError(f"@make on {fn.__qualname__}: timeout_s must be a positive number of seconds; got {timeout_s!r}")
        if retries is not None and (not _is_int(retries) or retries < 0):
            raise MakeError(f"@make on {fn.__qualname__}: retries must be an int >= 0 (0: never re-sent); got {retries!r}")
        if max_concurrency is not None and (not _is_int(max_concurrency) or max_concurrency < 1):
            raise MakeError(
                f"@make on {fn.__qualname__}: max_concurrency must be a positive int (calls in flight per replica); "
                f"got {max_concurrency!r}"
            )
        self.fn = fn
        self.batch = batch
        # Its calls never overlap with the request's other calls (a method with side effects): deployed with
        # parallel calls, the request waits for every call in flight before it, and for it before going on.
        self.ordered = ordered
        # It changes nothing another call or the pipeline's code could see (a search, an embedding, a
        # generation): deployed with parallel calls, only such calls overlap one another. A method not declared
        # so keeps plain Python's place, as `ordered=True` does: whatever it writes, a later call reads.
        self.read_only = read_only
        # What a deployment batches this method's calls up to unless deploy() or a Plan says otherwise:
        # a batch method batches for real; a per-item method runs its calls one by one, or, with
        # max_concurrency, that many at once (its batch size is its calls in flight per replica).
        asynchronous = inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)
        if max_concurrency is None and asynchronous and not batch:
            # Its calls await together on one loop, as asyncio code expects (Ray Serve's async methods too).
            max_concurrency = max_batch_size or DEFAULT_ASYNC_CONCURRENCY
        self.max_batch_size: int = max_batch_size or max_concurrency or (DEFAULT_BATCH_SIZE if batch else 1)
        # How long one batch of it may run before its replica counts as stuck; None: the deployment's call_timeout_s.
        self.timeout_s: float | None = None if timeout_s is None else float(timeout_s)
        # Times a call is re-sent to another replica after its replica died or got stuck running it;
        # None: the deployment's max_retries. 0 for a call that must not run twice.
        self.retries: int | None = retries
        # Calls one replica runs at once, from batches sent as calls arrive without waiting for those
        # ahead (continuous batching: an engine that batches internally admits them between its steps);
        # None: one batch at a time. Such a method must be safe to run from several threads at once (an async
        # one: several of its calls awaiting at once on the loop; DEFAULT_ASYNC_CONCURRENCY where not given).
        self.max_concurrency: int | None = max_concurrency
        # A generator function yielding text chunks: a pipeline's call gets their concatenation, and a
        # deployment can send the chunks to a streaming client as they are made.
        self.stream: bool = stream
        # An `async def` (or an async generator): its coroutines run on the process's component loop,
        # a replica's concurrent calls as tasks there, not threads (see event_loop.py).
        self.asynchronous: bool = asynchronous
        self.name: str = fn.__name__
        self.qualname: str = fn.__qualname__
        self.signature = inspect.signature(fn)
        # It takes the request's `CallOptions` (core/options.py) when it is the call that answers the request.
        self.takes_options: bool = OPTIONS_ARGUMENT in self.signature.parameters
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def __set_name__(self, owner: type, name: str) -> None:
        if not (isinstance(owner, type) and issubclass(owner, Component)):
            raise MakeError(
                f"@make on {owner.__qualname__}.{name}: {owner.__qualname__} does not derive from "
                "patchkit.Component; write `class " + owner.__name__ + "(patchkit.Component):`"
            )
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> MakeMethod: ...
    @overload
    def __get__(self, obj: Component, objtype: type | None = None) -> BoundMake: ...
    def __get__(self, obj: Component | None, objtype: type | None = None) -> MakeMethod | BoundMake:
        if obj is None:
            return self
        return BoundMake(obj, self)

    def run_local(self, component: Component, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run one call in this process (Jupyter prototyping, capture's eager run)."""
        return self.run_batch(component, [(args, kwargs)])[0]

    def run_batch(self, component: Component, calls: Sequence[Call], hook: CallHook | None = None) -> list[Any]:
        """Run a batch of calls: one call of a `batch=True` method over lists, else one call each.

        Called by a worker for every batch it receives, and by `run_local` with a batch of one. A
        component's own code runs under `hook`: the `@make` calls it makes to components it holds
        go through it. None (eagerly, and for components it holds privately) runs them right here;
        a worker passes one that sends calls of components deployed on their own to their replicas.
        """
        with call_hook(hook):
            return self._run_batch(component, calls)

    def run_chunks(
        self, component: Component, args: tuple[Any, ...], kwargs: dict[str, Any], hook: CallHook | None = None
    ) -> Generator[Chunk, None, None]:
        """One call of a `stream=True` method, chunk by chunk, set up and under `hook` as `run_batch` runs it.

        Closing the iterator closes the method's own generator, which ends its work there.
        """
        ensure_setup(component)
        if self.asynchronous:
            with call_hook(hook):  # the stream starts on the loop now, in this context: with the hook
                streamed = component_loop().iterate(self.achunks(component, args, kwargs), self.qualname)
            yield from streamed
            return
        chunks = self.chunks(component, args, kwargs)
        try:
            while True:
                with call_hook(hook):
                    chunk = next(chunks, None)
                if chunk is None:
                    return
                yield chunk
        finally:
            chunks.close()

    def _run_batch(self, component: Component, calls: Sequence[Call]) -> list[Any]:
        """The synchronous edge of `_arun_batch`: on the component loop, this thread waiting, or here."""
        ensure_setup(component)
        if self.asynchronous:  # a running loop in this thread is no matter: it is not the one that runs it
            return component_loop().run(self._arun_batch(component, calls), self.qualname)
        return run_inline(self._arun_batch(component, calls))

    async def run_batch_async(self, component: Component, calls: Sequence[Call], hook: CallHook | None = None) -> list[Any]:
        """`run_batch` of an `async def` method, on the component loop; the component is set up.

        Awaited by a worker or the inprocess backend for a batch of it. A per-item method's calls await
        together (a task each); a batch method is awaited once for the whole batch.
        """
        with call_hook(hook):
            return await self._arun_batch(component, calls)

    async def call_async(self, component: Component, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of an `async def` per-item method, awaited on the component loop (the caller's context holds its hook).

        Each of its steps watched (`event_loop.watched`).
        """
        return await watched(self.fn(component, *args, **kwargs), self.qualname)

    async def _arun_batch(self, component: Component, calls: Sequence[Call]) -> list[Any]:
        """A batch's calls: the one implementation, for a plain `def` method as for an `async def` one.

        A plain method's calls run one after another and never wait, so its synchronous edge runs this here
        (`run_inline`); an `async def` method's per-item calls await together on the loop.
        """
        if self.batch:
            made = self.fn(component, *self._columns(component, calls))
            return self._results(await watched(made, self.qualname) if self.asynchronous else made, calls)
        if not self.asynchronous:
            one = self._joined if self.stream else self._call_here
            return [await one(component, args, kwargs) for args, kwargs in calls]
        if self.stream:
            return list(await asyncio.gather(*(self._joined(component, args, kwargs) for args, kwargs in calls)))
        runs = [asyncio.ensure_future(self.call_async(component, args, kwargs)) for args, kwargs in calls]
        try:  # a task each, awaiting together
            return list(await asyncio.gather(*runs))
        finally:
            for run in runs:
                run.cancel()

    async def _call_here(self, component: Component, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of a plain `def` per-item method, in the calling thread."""
        return self.fn(component, *args, **kwargs)

    async def _joined(self, component: Component, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """One call of a `stream=True` method: its chunks joined (an `Answer` where it reported last)."""
        return joined([chunk async for chunk in self.achunks(component, args, kwargs)])

    def _results(self, results: Any, calls: Sequence[Call]) -> list[Any]:
        """A batch method's results, checked to be one per call."""
        if not isinstance(results, (list, tuple)) or len(results) != len(calls):
            got = f"{len(results)} results" if isinstance(results, (list, tuple)) else type(results).__name__
            raise MakeError(
                f"{self.qualname} is @make(batch=True): it must return a list with one result per "
                f"input, {len(calls)} here; it returned {got}"
            )
        return list(results)

    def chunks(self, component: Component, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Generator[Chunk, None, None]:
        """The text chunks of one call of a `stream=True` method, as it yields them: the synchronous edge of `achunks`.

        Each checked to be a str. An async generator runs on the component loop, its chunks handed to this thread as they
        come; a plain one runs here.
        """
        if self.asynchronous:
            yield from component_loop().iterate(self.achunks(component, args, kwargs), self.qualname)
        else:
            yield from iterate_inline(self.achunks(component, args, kwargs))

    async def achunks(self, component: Component, args: tuple[Any, ...], kwargs: dict[str, Any]) -> AsyncGenerator[Chunk, None]:
        """The text chunks of one call of a `stream=True` method: the one implementation, for a generator or an async one.

        An async generator's chunks come on the component loop, each of its steps watched. Each chunk checked to be a str.
        Closing it closes the method's generator.
        """
        made = self.fn(component, *args, **kwargs)
        try:
            while True:
                try:
                    chunk = await self._next_chunk(made)
                except StopAsyncIteration:
                    return
                yield self._chunk(chunk)
        finally:
            if self.asynchronous:
                await made.aclose()
            else:
                made.close()

    async def _next_chunk(self, made: Any) -> Any:
        """The method's generator's next chunk; StopAsyncIteration at its end."""
        if self.asynchronous:
            return await watched(made.__anext__(), self.qualname)
        try:
            return next(made)
        except StopIteration:
            raise StopAsyncIteration from None

    def _chunk(self, chunk: Any) -> Chunk:
        if not isinstance(chunk, (str, CallReport)):
            got = type(chunk).__name__
            raise MakeError(f"{self.qualname} is @make(stream=True): it must yield str chunks; it yielded a {got}")
        return chunk

    def _columns(self, component: Component, calls: Sequence[Call]) -> list[list[Any]]:
        params = list(self.signature.parameters)[1:]
        columns: list[list[Any]] = [[] for _ in params]
        for args, kwargs in calls:
            if not kwargs and len(args) == len(params):  # every parameter given by position: no binding needed
                for column, value in zip(columns, args):
                    column.append(value)
                continue
            try:
                bound = self.signature.bind(component, *args, **kwargs)
            except TypeError as exc:
                raise TypeError(f"{self.qualname}(): {exc}") from None
            bound.apply_defaults()
            for column, name in zip(columns, params):
                column.append(bound.arguments[name])
        return columns


class BoundMake:
    """`component.method` for a `@make` method: calling it goes through the active hook."""

    __slots__ = ("component", "method")

    def __init__(self, component: Component, method: MakeMethod) -> None:
        self.component = component
        self.method = method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the method: through the active hook (recorded, or sent to a worker), else here, eagerly."""
        hook = active_call_hook()
        if hook is not None:  # the call site is the frame calling this method: the code that wrote the call
            return hook(self.component, self.method, args, kwargs, site_of(sys._getframe(1)))
        return self.method.run_local(self.component, args, kwargs)

    def __repr__(self) -> str:
        return f"<make method {self.method.qualname} of {self.component!r}>"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_target(fn: Any, *, batch: bool, stream: bool) -> None:
    """Reject what @make cannot serve when it is applied, naming the target."""
    if isinstance(fn, (staticmethod, classmethod, property)):
        raise MakeError(f"@make decorates instance methods of a Component; got a {type(fn).__name__}")
    if not inspect.isfunction(fn):
        raise MakeError(f"@make decorates methods of a Component subclass; got {fn!r}")
    owner = fn.__qualname__.rsplit(".", 2)
    if len(owner) < 2 or owner[-2] == "<locals>":
        raise MakeError(
            f"@make on {fn.__qualname__}: it is a plain function; define it as a method of a class "
            "that derives from patchkit.Component"
        )
    generator = inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn)
    if stream and (batch or not generator):
        shape = "a per-item method, not batch=True" if batch else "a generator function (a def or async def that yields)"
        raise MakeError(f"@make(stream=True) on {fn.__qualname__}: it must be {shape} yielding str chunks; "
                        "an engine batching concurrent calls itself takes max_concurrency=N")
    if generator and not stream:
        raise MakeError(f"@make on {fn.__qualname__}: a method yielding text chunks takes @make(stream=True); "
                        "any other returns its result (a def, or an async def)")
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].kind not in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        raise MakeError(f"@make on {fn.__qualname__}: a method needs `self` as its first parameter")
    if batch and any(p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params):
        raise MakeError(
            f"@make(batch=True) on {fn.__qualname__}: a batch method takes one list per named "
            "parameter, so *args, **kwargs and keyword-only parameters cannot be batched"
        )


@overload
def make(fn: F, /) -> F: ...
@overload
def make(
    *,
    batch: bool = False,
    max_batch_size: int | None = None,
    timeout_s: float | None = None,
    retries: int | None = None,
    max_concurrency: int | None = None,
    stream: bool = False,
    ordered: bool = False,
    read_only: bool = False,
) -> Callable[[F], F]: ...
def make(
    fn: Any = None,
    /,
    *,
    batch: bool = False,
    max_batch_size: int | None = None,
    timeout_s: float | None = None,
    retries: int | None = None,
    max_concurrency: int | None = None,
    stream: bool = False,
    ordered: bool = False,
    read_only: bool = False,
) -> Any:
    """Mark a Component method as a pipeline step: `@make`, `@make()` or `@make(batch=True)`.

    The method may be `async def` (an async generator with `stream=True`): pipeline code calls it as
    any method, while its coroutines run on the process's component loop, a replica's concurrent calls
    as tasks there, with no thread each.

    Parallel calls (deployed, a request's calls are submitted as its code reaches them and waited for where
    their results are first used): a call of a `read_only` method overlaps other read-only calls; a call
    of any other method keeps plain Python's place: it waits for every call issued before it, and the code
    waits for it before going on.

        class Retriever(patchkit.Component):
            @patchkit.make(batch=True, max_batch_size=64, read_only=True)
            def retrieve(self, queries: list[str]) -> list[list[str]]:
                ...

    Args:
        fn: the method, when the decorator is written without parentheses (`@make`).
        batch: the method is written over lists (one list per parameter, a list of results back) while
            pipeline code still calls it with one item, as Ray Serve's `@serve.batch`.
        max_batch_size: the deployed batch size unless deploy() or a Plan sets one (default: 32 for a
            batch method, 1 for a per-item method, `max_concurrency` where that is given).
        timeout_s: when deployed, how long one batch of the method may run (default: the deployment's
            `call_timeout_s`); past it the replica is recycled and the batch's calls are retried elsewhere
            or fail with DeadlineExceeded.
        retries: how many times a call is re-sent to another replica after its replica died or got stuck
            (default: the deployment's `max_retries`); 0 for a method whose calls must not run twice.
        max_concurrency: the method is safe to run from several threads at once, and a replica takes its
            calls as they arrive, up to this many in flight, without waiting for the batch ahead to finish
            (an engine that batches internally, as vLLM's, or a method that mostly waits on others). Its
            deployed batch size is its calls in flight per replica (at most `max_concurrency`: a Plan or
            deploy(batch_size=...) that picks c runs c at once), and the profiler measures it at 1 to
            `max_concurrency` calls at once, not at batch sizes. An `async def` per-item method (an
            async generator too) left without it takes `max_batch_size`, else DEFAULT_ASYNC_CONCURRENCY
            (32): its calls await together on the replica's loop.
        stream: marks a per-item generator function yielding str chunks (tokens): pipeline code still
            gets the whole string, while a streaming request to a deployment whose output it makes
            receives the chunks as they come.
        ordered: the method has effects: its calls keep plain Python's order (the default for a method
            that is not `read_only`, said explicitly).
        read_only: a promise that the method changes nothing another call or the pipeline's code could
            see (no store, file or state written), so that deployed, its calls overlap the request's other
            read-only calls; a call of a method without it keeps its place. Not checked: a method declared
            so that writes can be reordered against the request's later reads (the deployed answer then
            differs from plain Python's). It orders one request's calls only, not concurrent requests'
            nor a component's replicas.

    Returns:
        The method marked (`@make`), or the decorator that marks it (`@make(...)`).

    Raises:
        MakeError: a target or option it cannot serve, when the decorator is applied: a function that is
            not a Component's instance method, options given positionally, a bound that is not a positive
            number, `ordered` with `read_only`.
    """
    options: dict[str, Any] = {"batch": batch, "max_batch_size": max_batch_size, "timeout_s": timeout_s, "retries": retries,
               "max_concurrency": max_concurrency, "stream": stream, "ordered": ordered, "read_only": read_only}
    if fn is None:
        return lambda f: MakeMethod(f, **options)
    if not callable(fn):
        raise MakeError(f"@make takes keyword options only, as @make(batch=True); got {fn!r}")
    return MakeMethod(fn, **options)


def make_methods(cls: type) -> dict[str, MakeMethod]:
    """The `@make` methods of a Component class by name, inherited ones included."""
    found: dict[str, MakeMethod] = {}
    for klass in reversed(cls.__mro__):
        found.update({k: v for k, v in vars(klass).items() if isinstance(v, MakeMethod)})
    return found
