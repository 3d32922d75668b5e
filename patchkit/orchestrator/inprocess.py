"""The `inprocess` backend: replicas run the user's own objects, in the front-end's process.

For unit tests and pdb: nothing is pickled and no process is started. A batch runs on a thread, so
that batches of different components overlap as they do on workers (a request's parallel calls
included) while the loop goes on, except a batch of a method whose last batch took under
`INLINE_BELOW_S`: that runs inline, on the loop, where a thread's hop would cost more than it lets
overlap. A component runs one batch at a time, and never at once with a component that holds it (which
runs it in place here), so no object is used from two threads. A batch of an `async def` method runs
on the process's component loop, as on a worker, and is awaited here: a per-item method's calls (its
`max_concurrency`, `DEFAULT_ASYNC_CONCURRENCY` where not given) await together there, beside the
other batches of the component, as on a worker; a batch method's batches take the locks. A call whose
request ends, or whose request runs out of time, has its task cancelled there. Batching and the pipeline's control
flow are the same as on the process backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from patchkit import telemetry
from patchkit.capture.holders import given_components
from patchkit.core import Component, MakeMethod, ensure_setup
from patchkit.core.event_loop import ChunkWindow, component_loop
from patchkit.errors import WorkerDiedError
from patchkit.orchestrator.backend import Backend, Replica, ReplicaSpec
from patchkit.orchestrator.envelope import CallEnvelope, when_read
from patchkit.orchestrator.execute import Outcome, StopFlag, component_stats, run_calls, run_calls_async, setup_error
from patchkit.orchestrator.resources import ReplicaResources

__all__ = ["INLINE_BELOW_S", "InProcessBackend"]

INLINE_BELOW_S = 0.002


class DirectChannel:
    """Runs each batch on a thread, holding the locks of its component and of every component it holds."""

    def __init__(self, component: Component, name: str, locks: Sequence[asyncio.Lock]) -> None:
        self.component = component
        self.name = name
        self.lost = asyncio.Event()
        self.lost_reason = ""
        self.batches = 0
        self.calls = 0
        self._locks = locks  # in one order for every channel, so that no two wait on each other
        self._took: dict[str, float] = {}  # method -> how long its last batch ran
        self._slots: dict[str, asyncio.Semaphore] = {}  # async method with max_concurrency -> its calls in flight

    async def run_batch(self, method: str, calls: Sequence[CallEnvelope]) -> list[Outcome]:
        """Run the batch, in an execution span per traced call, as a worker does; a streaming call's
        chunks handed to its `on_chunk` on this loop as they are made (`expires` does not apply to a plain
        `def` method's: no call waits here). Once the batch is given up on (its replica recycled) or a
        call's request ends, a streamed call stops at its next chunk, and an `async def` method's call is
        cancelled where it awaits."""
        if self.lost.is_set():
            raise WorkerDiedError(f"inprocess replica is stopped: {self.lost_reason}")
        made = getattr(type(self.component), method, None)
        run = self._run_async if isinstance(made, MakeMethod) and made.asynchronous else self._run
        windows = _windows(calls)
        streamed = any(call.on_chunk is not None for call in calls)
        sink = _sink(asyncio.get_running_loop(), calls, windows) if streamed else None
        traces = [call.trace for call in calls] if any(call.trace is not None for call in calls) else None
        with _stopped_when_ended(calls) as stops:
            outcomes = await run(method, calls, _Streaming(sink, stops, windows), traces)
        self.batches += 1
        self.calls += len(calls)
        return outcomes

    async def _run(self, method: str, calls: Sequence[CallEnvelope], streaming: _Streaming,
                   traces: list[dict[str, str] | None] | None) -> list[Outcome]:
        """A batch of a plain `def` method: on a thread, or inline when it is quick and streams nothing."""
        with telemetry.execution(self.name, method, traces):
            given = (streaming.sink, streaming.stops, None, streaming.windows) if streaming.sink is not None else ()
            args = (self.component, method, [call.call for call in calls], *given)
            inline = streaming.sink is None and self._took.get(method, INLINE_BELOW_S) < INLINE_BELOW_S
            return await (self._inline(*args) if inline else self._on_thread(self._timed, *args))

    async def _run_async(self, method: str, calls: Sequence[CallEnvelope], streaming: _Streaming,
                         traces: list[dict[str, str] | None] | None) -> list[Outcome]:
        """A batch of an `async def` method: its calls as tasks on the component loop (`run_calls_async`), under
        the locks or a slot (`_admitting`); each cancelled there at its `expires` too."""
        now, clock = time.monotonic(), asyncio.get_running_loop().time()
        deadlines = [None if call.expires is None else now + call.expires - clock for call in calls]
        async with self._admitting(method):
            with telemetry.execution(self.name, method, traces):
                run = run_calls_async(self.component, method, [call.call for call in calls], streaming.sink,
                                      streaming.stops, deadlines, None, streaming.windows)
                return await asyncio.wrap_future(component_loop().submit(run))

    def _admitting(self, method: str) -> contextlib.AbstractAsyncContextManager[Any]:
        """What a batch of an async method waits for: a slot of its `max_concurrency` (its calls await together
        on the component loop, beside the batches of the others, as on a worker), else the locks."""
        made = getattr(type(self.component), method)
        if not made.max_concurrency:
            return self._holding()
        if method not in self._slots:
            self._slots[method] = asyncio.Semaphore(made.max_concurrency)
        return self._slots[method]

    def _timed(self, component: Component, method: str, *args: Any) -> list[Outcome]:
        """`run_calls`, its time kept for the method's next batch to choose where it runs."""
        started = time.perf_counter()
        try:
            return run_calls(component, method, *args)
        finally:
            self._took[method] = time.perf_counter() - started

    @contextlib.asynccontextmanager
    async def _holding(self) -> AsyncIterator[None]:
        """The locks of this component and of those it holds, taken in their one order."""
        async with contextlib.AsyncExitStack() as held:
            for lock in self._locks:
                await held.enter_async_context(lock)
            yield

    async def _inline(self, *args: Any) -> list[Outcome]:
        """A quick batch, on the loop, once its component is free."""
        async with self._holding():
            return self._timed(*args)

    async def _on_thread(self, fn: Callable[..., list[Outcome]], *args: Any) -> list[Outcome]:
        """`fn(*args)` on a thread, under the locks until it returns, even if the waiting task is cancelled."""
        async with self._holding():
            running = asyncio.ensure_future(asyncio.to_thread(fn, *args))
            try:
                return await asyncio.shield(running)
            except asyncio.CancelledError:
                await asyncio.wait([running])  # the thread cannot be stopped: keep the component until it ends
                raise

    async def health(self, timeout_s: float) -> None:
        """The component's `check_health()`, run here on the loop."""
        self.component.check_health()

    async def stats(self) -> dict[str, Any]:
        return {"batches": self.batches, "calls": self.calls, "component_stats": component_stats(self.component)}

    async def close(self) -> None:
        if not self.lost.is_set():
            self.lost_reason = "stopped"
            self.lost.set()


@dataclass
class _Streaming:
    """Where a batch's chunks go (None: no call's chunks are read as they come), each call's stop and window."""

    sink: Callable[[int, str], None] | None
    stops: list[StopFlag]
    windows: list[ChunkWindow | None]


@contextlib.contextmanager
def _stopped_when_ended(calls: Sequence[CallEnvelope]) -> Iterator[list[StopFlag]]:
    """A stop per call, set once its request ends (its `ended` future is cancelled), and every one of them if
    the batch is given up on (the task awaiting it is cancelled)."""
    stops = [StopFlag() for _ in calls]
    watched = [(call.ended, lambda future, stop=stop: future.cancelled() and stop.set())
               for call, stop in zip(calls, stops) if call.ended is not None]
    for end, stop_on_end in watched:
        end.add_done_callback(stop_on_end)
    try:
        yield stops
    except asyncio.CancelledError:
        for stop in stops:
            stop.set()
        raise
    finally:
        for end, stop_on_end in watched:
            end.remove_done_callback(stop_on_end)


def _windows(calls: Sequence[CallEnvelope]) -> list[ChunkWindow | None]:
    """A window per call whose chunks are read as they come: its generator waits for a slow reader."""
    return [ChunkWindow() if call.on_chunk is not None else None for call in calls]


def _sink(loop: asyncio.AbstractEventLoop, calls: Sequence[CallEnvelope], windows: Sequence[ChunkWindow | None]
          ) -> Callable[[int, str], None]:
    """Where a batch's chunks go from the thread or loop that makes them: to their call's `on_chunk` on the
    front-end's `loop`, each giving its place in its window back once its reader has it."""

    def hand_on(index: int, text: str) -> None:
        target, window = calls[index].on_chunk, windows[index]
        if target is not None:
            handed = target(text)
            if window is not None:
                when_read(handed, window.give)

    def sink(index: int, text: str) -> None:  # on the thread or loop that makes the chunk
        loop.call_soon_threadsafe(hand_on, index, text)

    return sink


class InProcessBackend(Backend):
    name = "inprocess"

    def place(self, placed: Sequence[tuple[str, int]], planned: bool) -> list[ReplicaResources]:
        """Nothing is pinned: every replica is an object of this process."""
        return [ReplicaResources() for _ in placed]

    def place_one(self, resource: str, units: int, planned: bool, running: Sequence[Replica]) -> ReplicaResources:
        return ReplicaResources()

    def __init__(self) -> None:
        self._started: list[Replica] = []
        self._locks: dict[int, tuple[Component, asyncio.Lock]] = {}  # by id of each component object in use

    async def start(self, spec: ReplicaSpec, replica_id: str) -> Replica:
        try:
            ensure_setup(spec.instance)
        except Exception as exc:
            raise setup_error(spec.component, exc) from None
        replica = Replica(replica_id, spec, DirectChannel(spec.instance, spec.component, self._locks_of(spec.instance)))
        self._started.append(replica)
        return replica

    def _locks_of(self, component: Component) -> list[asyncio.Lock]:
        """The locks of `component` and of the components it holds (run in place here), in id order."""
        found = {id(c): c for c in [component, *given_components(component)]}
        for key, obj in found.items():
            if key not in self._locks:
                self._locks[key] = (obj, asyncio.Lock())
        return [self._locks[key][1] for key in sorted(found)]

    async def stop(self, replica: Replica) -> None:
        await replica.channel.close()
        if replica in self._started:
            self._started.remove(replica)

    def replicas(self) -> list[Replica]:
        return list(self._started)

    async def watch(self, replica: Replica) -> str:
        await replica.channel.lost.wait()
        return replica.channel.lost_reason
