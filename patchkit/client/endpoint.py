"""The `Endpoint` that `deploy()` returns: the user's handle on a deployment, over HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Literal, overload
from urllib.parse import quote

import httpx

from patchkit.client.pipeline_client import PipelineClient
from patchkit.client.streams import AsyncStream, Step, Stream
from patchkit.errors import ConfigError, DeadlineExceeded, PatchkitError, error_from_json
from patchkit.program.pipeline import Pipeline, stamp
from patchkit.server.reports import PlanReport, Stats

if TYPE_CHECKING:
    from patchkit.scheduler.online.traces import Trace

__all__ = ["Endpoint", "PipelineClient", "Updater"]

# A query waits this much longer than the endpoint's own request timeout, after which the endpoint answers 504
# itself: a reply later than that is lost on the way, not slow. Other routes answer at once, or within 60 s.
TIMEOUT_MARGIN_S = 5.0
OTHER_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0
# One connection per call in flight (as many as the caller makes: the endpoint's admission bounds them, not the
# client, whose waits would count against each call's timeout); this many idle ones are kept for the next calls.
LIMITS = httpx.Limits(max_connections=None, max_keepalive_connections=100)
QUERY_PATH = "/v1/query"


# How an endpoint's pipelines are changed: (pipelines by name, names to remove) -> the versions now served, by name.
Updater = Callable[[dict[str, Pipeline], list[str]], dict[str, dict[str, Any]]]


class Endpoint:
    """Deployed pipelines, as `deploy()` returns them: query them, update them, close them.

        with patchkit.deploy(pipeline) as endpoint:
            endpoint.query(query="What is a generator?")
            for chunk in endpoint.stream(query="What is a generator?"):
                print(chunk, end="")

    `query`, `aquery`, `stream` and `astream` run the one pipeline served; `endpoint[name]` is one of
    several. Calls share pooled keep-alive connections: one client for every thread's `query`, one per
    event loop for `aquery`. A call that gets no answer within the endpoint's `request_timeout_s` (plus a
    margin) raises DeadlineExceeded. Also a context manager; whatever is still open closes when the
    interpreter exits. Made by `deploy()`, not by hand.

    Attributes:
        url: where the endpoint's HTTP API answers (`POST {url}/v1/query`).
    """

    def __init__(
        self, url: str, closer: Callable[[], None], *, timeout_s: float = 300.0, headers: Mapping[str, str] | None = None,
        updater: Updater | None = None,
    ) -> None:
        """Called by `deploy()` once the front-end answers.

        Args:
            url: where the endpoint's HTTP API answers.
            closer: what `close()` calls to stop the front-end and its workers.
            timeout_s: the endpoint's request timeout.
            headers: sent with every request (sync and async), such as its bearer token.
            updater: how `update` reaches the front-end (None: this endpoint takes no updates).
        """
        self.url = url
        self._updater = updater
        self._headers = {"Accept": "application/json", **(headers or {})}
        self._query_timeout = httpx.Timeout(timeout_s + TIMEOUT_MARGIN_S, connect=CONNECT_TIMEOUT_S)
        self._timeout = httpx.Timeout(OTHER_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        self._client = httpx.Client(base_url=url, headers=self._headers, timeout=self._timeout, limits=LIMITS)
        # By event loop: its client, and the async generator that holds it open (see `_async_client`).
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, tuple[httpx.AsyncClient, AsyncGenerator[None, None]]]
        self._async = weakref.WeakKeyDictionary()
        self._closing: set[asyncio.Future[None]] = set()
        self._lock = threading.Lock()
        self._closer: Callable[[], None] | None = closer
        self._finalizer = weakref.finalize(self, closer)  # also runs at interpreter exit

    # -- requests -------------------------------------------------------------------------------
    def query(self, **inputs: Any) -> Any:
        """Run the pipeline on `inputs` and return its output.

        Args:
            **inputs: the pipeline's inputs by name; those left out keep their value at capture.

        Returns:
            What `pipeline(**inputs)` returns, as JSON carried it.

        Raises:
            PatchkitError: the error the endpoint answered, as its type: InputError, ComponentError,
                DeadlineExceeded, Overloaded, ...
            ConnectionError: the endpoint cannot be reached.
        """
        return self._query(QUERY_PATH, inputs)

    async def aquery(self, **inputs: Any) -> Any:
        """`query` for asyncio code: thousands may wait at once on one event loop.

        Args:
            **inputs: the pipeline's inputs by name.

        Returns:
            The pipeline's output.

        Raises:
            PatchkitError: the error the endpoint answered, as `query` raises it.
            ConnectionError: the endpoint cannot be reached.
        """
        return await self._aquery(QUERY_PATH, inputs)

    @overload
    def stream(self, *, steps: Literal[False] = False, **inputs: Any) -> Stream: ...
    @overload
    def stream(self, *, steps: Literal[True], **inputs: Any) -> Stream[str | Step]: ...
    def stream(self, *, steps: bool = False, **inputs: Any) -> Stream[Any]:
        """Run the pipeline on `inputs`, streaming.

        Iterate the result for the output's text as it is produced, then read its `output` (and `request_id`). Nothing is sent
        until iteration starts.

            stream = endpoint.stream(query="What is a generator?")
            for chunk in stream:
                print(chunk, end="", flush=True)
            stream.output   # what query() returns

        Args:
            steps: also yield a `Step` as each component call starts and as it ends, among the chunks in the order
                they happened (a pipeline input named `steps` cannot be given here).
            **inputs: the pipeline's inputs by name.

        Returns:
            The stream. While iterating, it raises the error the endpoint answered or sent as its last event.
        """
        return self._stream(QUERY_PATH, inputs, steps)

    @overload
    def astream(self, *, steps: Literal[False] = False, **inputs: Any) -> AsyncStream: ...
    @overload
    def astream(self, *, steps: Literal[True], **inputs: Any) -> AsyncStream[str | Step]: ...
    def astream(self, *, steps: bool = False, **inputs: Any) -> AsyncStream[Any]:
        """`stream` for asyncio code.

        `async for chunk in endpoint.astream(...)`, then its `output`. Leaving the loop early (`break`) closes the stream: the
        endpoint cancels the request.

        Args:
            steps: also yield a `Step` as each component call starts and ends, as `stream` does.
            **inputs: the pipeline's inputs by name.

        Returns:
            The async stream.
        """
        return self._astream(QUERY_PATH, inputs, steps)

    def __getitem__(self, name: str) -> PipelineClient:
        """The client of pipeline `name` (one of those `pipelines()` lists): its `query`, `aquery`, `stream`, `astream`.

        Args:
            name: the pipeline's name, as it was deployed (`deploy({"crag": crag, ...})`).

        Returns:
            Its client; a name the endpoint does not serve fails at the first call, with PipelineNotFound.

        Raises:
            TypeError: `name` is not a non-empty string.
        """
        if not isinstance(name, str) or not name:
            raise TypeError(f"endpoint[name] takes a pipeline's name; got {name!r:.80}")
        return PipelineClient(self, name)

    def _query(self, path: str, inputs: dict[str, Any]) -> Any:
        return self._request("POST", path, {"inputs": inputs}, self._query_timeout)["output"]

    async def _aquery(self, path: str, inputs: dict[str, Any]) -> Any:
        self._check_open()
        client = await self._async_client()
        try:
            response = await client.post(path, json={"inputs": inputs}, timeout=self._query_timeout)
        except httpx.TransportError as exc:
            raise self._transport_error(exc, self._query_timeout) from exc
        return self._reply(response)["output"]

    def _stream(self, path: str, inputs: dict[str, Any], steps: bool = False) -> Stream[Any]:
        self._check_open()
        body = {"inputs": inputs, "stream": True, **({"steps": True} if steps else {})}

        def open_response() -> Any:
            return self._transport(lambda: self._client.stream("POST", path, json=body, timeout=self._query_timeout))

        return Stream(open_response, self._reply)

    def _astream(self, path: str, inputs: dict[str, Any], steps: bool = False) -> AsyncStream[Any]:
        self._check_open()
        body = {"inputs": inputs, "stream": True, **({"steps": True} if steps else {})}

        @contextlib.asynccontextmanager
        async def open_response() -> AsyncIterator[httpx.Response]:
            client = await self._async_client()
            try:
                async with client.stream("POST", path, json=body, timeout=self._query_timeout) as response:
                    yield response
            except httpx.TransportError as exc:
                raise self._transport_error(exc, self._query_timeout) from exc

        return AsyncStream(open_response, self._reply)

    # -- pipelines ------------------------------------------------------------------------------
    def pipelines(self) -> list[dict[str, Any]]:
        """Each pipeline served, as `GET /v1/pipelines` lists it.

        Name, version, digest, inputs, input_schema (the inputs object it takes, as JSON Schema), output, state
        ("ready", "unready", "starting", "draining"; "failed", with its `reason`, where a component it calls could not
        start or crashes at every restart; an older version still ending its requests: "retiring"), the components it
        calls and its requests in flight.
        """
        result: list[dict[str, Any]] = self._request("GET", "/v1/pipelines")["pipelines"]
        return result

    def readiness(self, pipeline: str | None = None) -> dict[str, Any]:
        """What `GET /readyz` answers, ready or not; or, named, what pipeline `pipeline`'s own probe answers.

        That probe is `GET /v1/pipelines/{name}/readyz`.

        Args:
            pipeline: a pipeline's name (None: the endpoint's readiness).

        Returns:
            The probe's body: `status` ("ready", "starting", "unready", "failed", "draining"; the endpoint's also
            "degraded": some pipelines failed, the others ready) and `reasons`; the endpoint's also `pipelines`
            (each one's) and `components` (each one not ready).

        Raises:
            PipelineNotFound: no pipeline of that name is served.
            ConnectionError: the endpoint cannot be reached.
        """
        path = "/readyz" if pipeline is None else f"/v1/pipelines/{quote(pipeline, safe='')}/readyz"
        self._check_open()
        try:
            response = self._client.get(path)
        except httpx.TransportError as exc:
            raise self._transport_error(exc, self._timeout) from exc
        body: dict[str, Any] = response.json() if response.status_code == 503 else self._reply(response)
        return body

    def update(self, pipelines: Pipeline | Mapping[str, Pipeline]) -> dict[str, dict[str, Any]]:
        """Serve new versions while serving.

        A component whose version is unchanged (its class, its attributes and default arguments, the module
        globals and helpers its code reads, its constructor arguments) keeps its workers (and their caches);
        any other starts new workers, `setup()` done, before a request reaches them. Every request that
        starts after this returns runs on the new version; those in flight end on theirs, and the workers no
        version calls any more stop once they have.

        Args:
            pipelines: one Pipeline, which replaces the only one served; or a mapping that updates pipelines
                by name, a new name adding one.

        Returns:
            Each new version as `pipelines()` lists it, by name.

        Raises:
            ConfigError: one Pipeline for an endpoint that serves several, or a name or pipeline that is
                not one; nothing is changed.
            PatchkitError: a component that fails to start (nothing is changed), or an endpoint that takes
                no updates from here.
        """
        if isinstance(pipelines, Pipeline):
            served = [row["name"] for row in self.pipelines() if row["state"] != "retiring"]
            if len(served) != 1:
                raise ConfigError(f"this endpoint serves {len(served)} pipelines ({', '.join(served)}): update them by "
                                  "name, as endpoint.update({name: pipeline})")
            pipelines = {served[0]: pipelines}
        if not isinstance(pipelines, Mapping) or not all(isinstance(p, Pipeline) for p in pipelines.values()):
            raise ConfigError(f"update() takes a Pipeline or a mapping of names to Pipelines; got {pipelines!r:.100}")
        return self._update(dict(pipelines), [])

    def remove(self, name: str) -> None:
        """Stop serving pipeline `name`: its requests in flight end, then the workers no other pipeline calls stop.

        Args:
            name: the pipeline's name.

        Raises:
            PatchkitError: a name the endpoint does not serve, or an endpoint that takes no updates from here.
        """
        self._update({}, [name])

    def _update(self, pipelines: dict[str, Pipeline], remove: list[str]) -> dict[str, dict[str, Any]]:
        self._check_open()
        if self._updater is None:
            raise PatchkitError(f"the endpoint at {self.url} takes no updates here: update it from the process that "
                                "deployed it, or with `patchkit serve --reload`")
        stamp(pipelines)  # the new versions, computed here where their code is (the front-end compares them)
        return self._updater(pipelines, remove)

    @contextlib.contextmanager
    def _transport(self, open_stream: Callable[[], Any]) -> Iterator[httpx.Response]:
        """A streamed reply, its transport errors raised as `query`'s are."""
        try:
            with open_stream() as response:
                yield response
        except httpx.TransportError as exc:
            raise self._transport_error(exc, self._query_timeout) from exc

    def stats(self) -> Stats:
        """Per component: replicas, batch sizes, throughput, queue lengths; and request counts (`GET /v1/stats`).

        Returns:
            A dict of the shape `Stats` describes.
        """
        result: Stats = self._request("GET", "/v1/stats?replicas=1")
        return result

    def plan(self) -> PlanReport:
        """What `GET /v1/plan` serves: per component its replicas and batch sizes, and the Plan applied, if any.

        Returns:
            A dict of the shape `PlanReport` describes.
        """
        result: PlanReport = self._request("GET", "/v1/plan")
        return result

    def traces(self) -> list[Trace]:
        """The last finished requests with an SLO (up to 5,000), each call with its times and queue wait.

        What the SLO estimators learn from, for `patchkit.scheduler.online.estimator.accuracy`.
        """
        from patchkit.scheduler.online.traces import Trace

        result: dict[str, Any] = self._request("GET", "/v1/traces")
        return [Trace.from_dict(trace) for trace in result["traces"]]

    def _request(self, method: str, path: str, payload: Any = None, timeout: httpx.Timeout | None = None) -> Any:
        self._check_open()
        timeout = timeout or self._timeout
        try:
            response = self._client.request(method, path, json=payload, timeout=timeout)
        except httpx.TransportError as exc:
            raise self._transport_error(exc, timeout) from exc
        return self._reply(response)

    def _check_open(self) -> None:
        if self._closer is None:
            raise PatchkitError(f"the endpoint at {self.url} is closed")

    async def _async_client(self) -> httpx.AsyncClient:
        """This event loop's client, made by its first `aquery`.

        An async generator holds it open: asyncio registers the generator with the loop at its first
        step, so that `asyncio.run` (`loop.shutdown_asyncgens()`) closes the client on its own loop
        before the loop closes, when that comes before `close()`.
        """
        loop = asyncio.get_running_loop()
        held = self._async.get(loop)  # only this loop's own tasks add its entry, with no await in between
        if held is not None:
            return held[0]
        client = httpx.AsyncClient(base_url=self.url, headers=self._headers, timeout=self._timeout, limits=LIMITS)
        holder = _hold(client)
        with self._lock:  # against close() on another thread
            self._async[loop] = (client, holder)
        await anext(holder)  # its first step registers it with this loop, and returns at once
        return client

    def _transport_error(self, exc: httpx.TransportError, timeout: httpx.Timeout) -> Exception:
        """What a caller sees when no answer came: DeadlineExceeded past the timeout, else ConnectionError."""
        if isinstance(exc, httpx.TimeoutException):
            waited = timeout.connect if isinstance(exc, httpx.ConnectTimeout) else timeout.read
            return DeadlineExceeded(f"no answer from the endpoint at {self.url} within {waited:g} s ({type(exc).__name__})")
        return ConnectionError(f"cannot reach the endpoint at {self.url}: {type(exc).__name__}: {exc}")

    @staticmethod
    def _reply(response: httpx.Response) -> Any:
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code >= 400:
            error = data.get("error") if isinstance(data, dict) else None
            if not isinstance(error, dict):
                error = {"message": f"HTTP {response.status_code}: {response.text[:500]}"}
            raise error_from_json(error)
        if data is None:
            raise PatchkitError(f"the endpoint answered HTTP {response.status_code} with a body that is not JSON: "
                                f"{response.text[:200]!r}")
        return data

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain in-flight requests, stop every worker and the front-end; nothing is left running."""
        if self._closer is None:
            return
        self._closer = None
        self._finalizer()
        self._client.close()
        with self._lock:
            held, self._async = list(self._async.items()), weakref.WeakKeyDictionary()
        for loop, (_, holder) in held:
            self._close_on(loop, holder)

    def _close_on(self, loop: asyncio.AbstractEventLoop, holder: AsyncGenerator[None, None]) -> None:
        """Close an event loop's client on that loop; a loop that is closed closed it already (`_async_client`)."""
        if loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is running:  # close() called from this loop's own code: the client closes at its next await
            task = loop.create_task(_release(holder))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        elif loop.is_running():  # another thread's loop
            asyncio.run_coroutine_threadsafe(_release(holder), loop)
        else:
            loop.run_until_complete(_release(holder))

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Endpoint {self.url}{' closed' if self._closer is None else ''}>"


async def _hold(client: httpx.AsyncClient) -> AsyncGenerator[None, None]:
    """Holds an event loop's client open until the generator is closed.

    By `Endpoint.close()`, or by the loop's `shutdown_asyncgens()` when it closes first.
    """
    try:
        yield
    finally:
        await client.aclose()


async def _release(holder: AsyncGenerator[None, None]) -> None:
    await holder.aclose()
