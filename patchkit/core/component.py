"""`Component`: the class a pipeline's parts derive from, and its setup, run once per instance wherever it runs.

A `Component` records its constructor arguments as it is created (its `ComponentSpec`), so any
process can rebuild it; state loaded by `setup()` never travels. Its `@make` methods are in `make.py`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import threading
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from patchkit.core.event_loop import component_loop, on_component_loop, watched
from patchkit.core.spec import ComponentSpec
from patchkit.errors import MakeError

__all__ = ["Component", "ensure_setup", "is_set_up", "mark_served_elsewhere", "release_setup"]


class Component:
    """Base class of every pipeline part.

    Subclasses write an ordinary `__init__`; its arguments are recorded without the subclass doing
    anything. Heavy state (models, indexes) belongs in `setup()`, which runs once, lazily, in the
    process that executes the component: the first local call, or a worker at start. A subclass's
    `setup` runs once per instance however often it is called (the user's own call included), so
    calling it ahead of the first call loads nothing twice. It may be `async def` (an async client
    opened on the loop its `async def` methods run on): calling it still loads, and returns, at once.
    """

    _patchkit_spec: ComponentSpec
    devices: tuple[str, ...] = ("cpu",)
    """The resource types one replica can run on, of "cpu" and "gpu"; the planner picks one per component.

    A class (or an instance, in its `__init__`) that can use a GPU says so: `("cpu", "gpu")` or `("gpu",)`.
    """
    in_place: tuple[str, ...] = ()
    """Constructor parameters whose components this one uses beyond their `@make` methods (their index, their
    model, their state): those run inside this component wherever it runs.

    A component given through any other parameter is deployed on its own and shared: its holder calls it
    through patchkit, its queue and its replicas (Deploying, "Shared components").
    """
    sensitive: bool = False
    """True: what its calls return is never shown outside the pipeline (step events carry no preview of it)."""
    version: str | None = None
    """A version you declare for what patchkit cannot see, as Ray Serve's `version=`: a file `setup()` reads
    that `version_files` does not name, a remote index, a model behind an API.

    Set it on the class, or on the instance in `__init__`; a new value is a new version of the component
    (`update()` and `--reload` start new workers for it), the same value changes nothing. It adds to what
    patchkit digests (the class's code, the globals it reads, the constructor's arguments, the files named),
    never replaces it.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Record the constructor's arguments: the component travels to its workers as them (its spec)."""
        self = super().__new__(cls)
        self.__dict__["_patchkit_spec"] = ComponentSpec(cls, args, dict(kwargs), uuid.uuid4().hex)
        self.__dict__["_patchkit_setup_lock"] = threading.RLock()
        self.__dict__["_patchkit_ready"] = False
        return self

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if inspect.isfunction(own := cls.__dict__.get("setup")):
            cls.setup = _once(own)  # type: ignore[method-assign,assignment]

    def setup(self) -> Awaitable[None] | None:
        """Load heavy state. Called once per instance in the process that runs it, before its first call there."""
        return None

    def version_files(self) -> Sequence[str | os.PathLike[str]]:
        """The files and directories this component's behaviour depends on, beyond its code and arguments.

        Called where the user's code runs (by `deploy()`, `update()`, `--reload` and `plan()`), once per
        update, to compute the component's version: a change of any of them (a file added to a corpus
        directory, a model file replaced) is a new version, whose workers load it again. A file of up to
        4 MiB counts by its content, a larger one by its size and modification time; a directory by each
        file under it (`patchkit.program.files`). The built-in retrievers name their corpus directory, the
        generators and the embedder their model. None by default.

        Returns:
            Paths of files or directories (missing ones count as missing).
        """
        return ()

    def stats(self) -> dict[str, Any]:
        """The component's own figures (hit rates, bytes moved, seconds spent).

        Called by its worker when the front-end asks a replica for its stats, on a thread other than the one running batches.
        Numbers, nested dicts of numbers allowed, appear in `/metrics` per replica; other values only in `Endpoint.stats()`. None
        by default.
        """
        return {}

    def prefix_key(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """A key naming the state a call of `method` reuses on the replica that ran it, or None.

        The state is, for instance, the prompt prefix whose KV state an LLM keeps. A deployment sends a call
        with a key to the replica that last ran a call with that key, unless that one is much busier than
        the least loaded (cache-aware routing). Called by the front-end for every call, so it must be cheap.

        Args:
            method: the `@make` method called.
            args: the call's positional arguments.
            kwargs: its keyword arguments.

        Returns:
            The key, or None (the default): no replica is preferred.
        """
        return None

    def check_health(self) -> None:
        """Raise if this replica should no longer serve (a lost connection, a wedged engine).

        Called by its worker for every periodic health check (`health_check_period_s`), on a thread other than the one running
        batches. A check that raises, or does not return within `health_check_timeout_s`, fails; after `health_check_failures`
        failures in a row the replica is recycled (stopped, another started in its place). Passes by default.
        """

    def teardown(self) -> None:
        """Release what `setup()` loaded (models, contexts, indexes), so that the memory comes back.

        Called by `plan()` on the components it set up in your process to record its calibration's calls
        (none you had set up before): a deployment runs its replicas in processes of their own, so the
        copies the calibration loaded here would otherwise stay for as long as your objects live. The
        next call made here runs `setup()` again. Not overriding it keeps what `setup()` loaded (and
        `setup()` does not run again).
        """

    def serve_sizes(self, batch_sizes: Mapping[str, int]) -> None:
        """Hear, before `setup()`, the batch size each `@make` method gets in this replica.

        Called in each replica a deployment starts; of a `max_concurrency` method, the size is the most
        of its calls at once. A component whose `setup()` allocates per call in flight (an engine's sequence slots and their KV)
        sizes that to these instead of to its `batch_limit`. Not called where no deployment sizes the
        replica (the profiler's replicas, eager calls), nor by the inprocess backend (its replicas share
        the one object), nor for an object whose `setup()` has run. Keeps nothing by default.

        Args:
            batch_sizes: by `@make` method name, its batch size in this deployment.
        """

    def batch_limit(self, method: str) -> int:
        """The largest batch of `method` this instance takes (its memory bound).

        The method's `@make(max_batch_size=...)` unless the instance knows better. Read by deploy() for default batch sizes and by
        the profiler as the batch size its search starts from.

        Args:
            method: the name of a `@make` method.

        Returns:
            The largest batch size.

        Raises:
            MakeError: `method` is not a `@make` method.
        """
        from patchkit.core.make import MakeMethod  # make.py builds on this module

        found = getattr(type(self), method, None)
        if not isinstance(found, MakeMethod):
            raise MakeError(f"{type(self).__name__}.{method} is not a @make method")
        return found.max_batch_size

    def __reduce__(self) -> tuple[Any, ...]:
        # Only the spec travels; the receiving process rebuilds the object and runs setup() itself.
        return (ComponentSpec.build, (self._patchkit_spec,))

    def __repr__(self) -> str:
        return self._patchkit_spec.describe()


# The components whose setup() runs in this context (thread, task), so that the calls their own setup
# makes (`super().setup()`, a `@make` call) run on what it has loaded so far instead of waiting for it.
_SETTING_UP: ContextVar[frozenset[int]] = ContextVar("patchkit_setting_up", default=frozenset())


def _once(setup: Callable[[Component], Any]) -> Callable[[Component], Any]:
    """`setup` run at most once per instance.

    Later calls return at once, and concurrent first calls wait for the one that runs it. A subclass's setup calling
    `super().setup()` runs the parent's inside its own run; the instance is ready when the outermost returns (not if it raises).

    An `async def setup` runs on the component loop (`event_loop.py`) while its caller waits; called on
    that loop (`await super().setup()` inside another async setup) it returns the coroutine to await.
    """

    # The wrapper names only `setup` and module-level functions: a class defined in `__main__` or a
    # notebook travels by value, and so does this wrapper with whatever it refers to.
    @functools.wraps(setup)
    def once(self: Component) -> Coroutine[Any, Any, None] | None:
        return _setup_once(self, setup)

    return once


def _setup_once(component: Component, setup: Callable[[Component], Any]) -> Coroutine[Any, Any, None] | None:
    """What `once` does.

    Run `setup` unless the instance is ready, in this context if its setup runs here already (a parent's), else under the
    instance's lock, marking it ready when it returns.
    """
    asynchronous = inspect.iscoroutinefunction(setup)
    if asynchronous and on_component_loop():
        return _once_on_loop(component, setup)
    state = component.__dict__
    if state["_patchkit_ready"]:
        return None
    if id(component) in _SETTING_UP.get():
        _run_setup(component, setup)
        return None
    with state["_patchkit_setup_lock"]:
        if state["_patchkit_ready"]:
            return None
        token = _SETTING_UP.set(_SETTING_UP.get() | {id(component)})
        try:
            _run_setup(component, setup)
        finally:
            _SETTING_UP.reset(token)
        state["_patchkit_ready"] = True
    return None


def _run_setup(component: Component, setup: Callable[[Component], Any]) -> None:
    """`setup` itself, in this thread; an async one on the component loop, this thread waiting."""
    if inspect.iscoroutinefunction(setup):
        component_loop().run(_watched_setup(component, setup), setup.__qualname__)
    else:
        setup(component)


async def _watched_setup(component: Component, setup: Callable[[Component], Any]) -> None:
    await watched(setup(component), setup.__qualname__)


async def _once_on_loop(component: Component, setup: Callable[[Component], Any]) -> None:
    """An async setup called on the component loop.

    The parent's, inside the instance's own setup, runs there; the instance's whole setup, if it has not run, runs from a thread
    that waits for the loop.
    """
    if component.__dict__["_patchkit_ready"]:
        return
    if id(component) in _SETTING_UP.get():
        await watched(setup(component), setup.__qualname__)
        return
    await asyncio.to_thread(ensure_setup, component)


def ensure_setup(component: Component) -> None:
    """Run `component.setup()` once in this process.

    Called before any local execution. A call the component's own setup makes runs on what that setup has loaded so far.
    """
    state = component.__dict__
    if state["_patchkit_ready"] or id(component) in _SETTING_UP.get():
        return
    with state["_patchkit_setup_lock"]:
        if not state["_patchkit_ready"]:
            if (pending := component.setup()) is not None:  # an async setup, asked for on the loop it runs on
                if inspect.iscoroutine(pending):
                    pending.close()
                raise MakeError(
                    f"{type(component).__name__} is not set up, and code running on patchkit's event loop (an "
                    "async method) cannot wait for its async setup(): set it up before, or call it from a plain def"
                )
            state["_patchkit_ready"] = True  # for the base's empty setup, which nothing wraps


def is_set_up(component: Component) -> bool:
    """Whether `component.setup()` has run in this process (or it is served elsewhere)."""
    return bool(component.__dict__["_patchkit_ready"])


def release_setup(component: Component) -> bool:
    """Release what `component.setup()` loaded here; whether it did.

    Runs `teardown()` where the class overrides it and `setup()` ran in this process, then marks the
    instance not set up, so that its next local call runs `setup()` again.
    """
    state = component.__dict__
    if type(component).teardown is Component.teardown or not state["_patchkit_ready"]:
        return False
    with state["_patchkit_setup_lock"]:
        if not state["_patchkit_ready"]:
            return False
        component.teardown()
        state["_patchkit_ready"] = False
    return True


def mark_served_elsewhere(component: Component) -> None:
    """Mark `component` as served by its own deployment, not by this process.

    It is held by a worker's component, whose calls of it go through the worker's hook, so its `setup()` never runs here.
    """
    component.__dict__["_patchkit_ready"] = True
