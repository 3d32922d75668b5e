"""`deploy()` and the `Endpoint` it returns: the user's handle on a served pipeline."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import secrets
import subprocess
import sys
import threading
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import cloudpickle
import httpx

from patchkit import envs
from patchkit.client.streams import AsyncStream, Stream
from patchkit.config import OPTIONS, DeploymentConfig
from patchkit.config.options import reference
from patchkit.errors import ConfigError, DeadlineExceeded, PatchkitError, error_from_json
from patchkit.program.pipeline import Pipeline, last_pipeline

if TYPE_CHECKING:
    from patchkit.scheduler.offline.plan import Plan
    from patchkit.scheduler.online.traces import Trace

__all__ = ["Endpoint", "PipelineClient", "deploy"]

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
    interpreter exits.

    Args:
        url: where the endpoint's HTTP API answers.
        closer: what `close()` calls to stop the front-end and its workers.
        timeout_s: the endpoint's request timeout.
        headers: sent with every request (sync and async), such as its bearer token.
        updater: how `update` reaches the front-end (None: this endpoint takes no updates).

    Attributes:
        url: where the endpoint's HTTP API answers (`POST {url}/v1/query`).
    """

    def __init__(
        self, url: str, closer: Callable[[], None], *, timeout_s: float = 300.0, headers: Mapping[str, str] | None = None,
        updater: Updater | None = None,
    ) -> None:
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

    def stream(self, **inputs: Any) -> Stream:
        """Run the pipeline on `inputs`, streaming.

        Iterate the result for the output's text as it is produced, then read its `output` (and `request_id`). Nothing is sent
        until iteration starts.

            stream = endpoint.stream(query="What is a generator?")
            for chunk in stream:
                print(chunk, end="", flush=True)
            stream.output   # what query() returns

        Args:
            **inputs: the pipeline's inputs by name.

        Returns:
            The stream. While iterating, it raises the error the endpoint answered or sent as its last event.
        """
        return self._stream(QUERY_PATH, inputs)

    def astream(self, **inputs: Any) -> AsyncStream:
        """`stream` for asyncio code.

        `async for chunk in endpoint.astream(...)`, then its `output`. Leaving the loop early (`break`) closes the stream: the
        endpoint cancels the request.

        Args:
            **inputs: the pipeline's inputs by name.

        Returns:
            The async stream.
        """
        return self._astream(QUERY_PATH, inputs)

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

    def _stream(self, path: str, inputs: dict[str, Any]) -> Stream:
        self._check_open()
        body = {"inputs": inputs, "stream": True}

        def open_response() -> Any:
            return self._transport(lambda: self._client.stream("POST", path, json=body, timeout=self._query_timeout))

        return Stream(open_response, self._reply)

    def _astream(self, path: str, inputs: dict[str, Any]) -> AsyncStream:
        self._check_open()
        body = {"inputs": inputs, "stream": True}

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

        Name, version, digest, inputs, output, state ("ready", "unready", "starting", "draining"; an older version still ending
        its requests: "retiring"), the components it calls and its requests in flight.
        """
        result: list[dict[str, Any]] = self._request("GET", "/v1/pipelines")["pipelines"]
        return result

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
        return self._updater(pipelines, remove)

    @contextlib.contextmanager
    def _transport(self, open_stream: Callable[[], Any]) -> Iterator[httpx.Response]:
        """A streamed reply, its transport errors raised as `query`'s are."""
        try:
            with open_stream() as response:
                yield response
        except httpx.TransportError as exc:
            raise self._transport_error(exc, self._query_timeout) from exc

    def stats(self) -> dict[str, Any]:
        """Per component: replicas, batch sizes, throughput, queue lengths; and request counts."""
        result: dict[str, Any] = self._request("GET", "/v1/stats?replicas=1")
        return result

    def plan(self) -> dict[str, Any]:
        """What `GET /v1/plan` serves: per component its replicas and batch sizes, and the Plan applied, if any."""
        result: dict[str, Any] = self._request("GET", "/v1/plan")
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


class PipelineClient:
    """One pipeline of an endpoint (`endpoint[name]`): its requests go to `POST /v1/pipelines/{name}/query`.

    Args:
        endpoint: the endpoint that serves it.
        name: the pipeline's name.
    """

    def __init__(self, endpoint: Endpoint, name: str) -> None:
        self.endpoint, self.name = endpoint, name
        self._path = f"/v1/pipelines/{quote(name, safe='')}/query"

    def query(self, **inputs: Any) -> Any:
        """As `Endpoint.query`, on this pipeline."""
        return self.endpoint._query(self._path, inputs)

    async def aquery(self, **inputs: Any) -> Any:
        """As `Endpoint.aquery`, on this pipeline."""
        return await self.endpoint._aquery(self._path, inputs)

    def stream(self, **inputs: Any) -> Stream:
        """As `Endpoint.stream`, on this pipeline."""
        return self.endpoint._stream(self._path, inputs)

    def astream(self, **inputs: Any) -> AsyncStream:
        """As `Endpoint.astream`, on this pipeline."""
        return self.endpoint._astream(self._path, inputs)

    def __repr__(self) -> str:
        return f"<PipelineClient {self.name!r} of {self.endpoint.url}>"


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


def deploy(
    pipeline: Pipeline | Mapping[str, Pipeline] | None = None,
    *,
    backend: str = "local",
    slo_ms: float | Mapping[str, float] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    replicas: int | Mapping[str, int] | None = None,
    batch_size: int | Mapping[str, int] | None = None,
    plan: Plan | str | None = None,
    resources: Mapping[str, int] | None = None,
    calibration: Sequence[Mapping[str, Any]] | Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
    weights: Mapping[str, float] | None = None,
    ray_address: str | None = None,
    **options: Any,
) -> Endpoint:
    """Serve `pipeline` (default: the last one captured) and return its Endpoint once every worker is ready.

    Several pipelines, by name (`deploy({"crag": crag, "hyde": hyde})`), are served by one deployment: each
    at `POST /v1/pipelines/{name}/query`, as `endpoint[name]` and as the OpenAI model `name`; a component
    object they share is deployed once (one set of workers, one batching queue per method), and a component
    whose name another pipeline's component took is named `pipeline/name` in `replicas=`, `batch_size=` and
    stats. `endpoint.update()` changes them while they serve.

    Every argument is checked before anything is planned or started. Every other option is a keyword
    argument (`**options`), held by a group of `patchkit.config.DeploymentConfig`; `patchkit serve` takes
    the same as config-file keys. `help(patchkit.deploy)` lists them at its end, and the documentation's
    table of options with their defaults.

    Args:
        pipeline: the pipeline to serve, or several by name (default: the last one captured).
        backend: "local" (a front-end process and one worker process per replica) or "inprocess" (a thread
            of this process running your own component objects, for tests and pdb) or "ray" (one Ray actor
            per replica, placed across a Ray cluster: `ray_address` names it; the options of its group
            `ray` take it further).
        slo_ms: the latency target of every request that brings none, in milliseconds; or targets by
            pipeline name.
        host: the address the HTTP server listens on.
        port: the port it listens on (0: any free port).
        replicas: a count for every component, or counts by component name (default 1).
        batch_size: a size for every method, or sizes by component or "component.method" (default: each
            method's `@make(max_batch_size=...)`; of a `max_concurrency` method, its calls at once per
            replica, at most that bound).
        plan: a `Plan` to apply, or "auto" to make one first with `patchkit.plan(pipeline, resources=,
            calibration=, weights=, slo_ms=)`: it sets every component's replicas, batch size and placement.
        resources: with `plan="auto"`, the pool to plan for, such as `{"cpu": 8, "gpu": 2}` (default: this
            machine's; with the ray backend, the cluster's).
        calibration: with `plan="auto"`, inputs to profile the pipeline on (by pipeline name, with several).
        weights: with `plan="auto"` and several pipelines, each one's share of the requests.
        ray_address: the Ray cluster the ray backend joins (default: the one this process is connected
            to, else RAY_ADDRESS, else a local one).
        **options: every other option by its flat name (`max_inflight_requests=`, `autoscale=`, ...).

    Returns:
        The Endpoint, every worker ready.

    Raises:
        ConfigError: an unknown option (with the closest known name), a value out of range, two options
            that conflict, or a planning argument without `plan="auto"`.
        PlanError: with `plan="auto"`, no plan fits the resources or the SLO.
        PatchkitError: a component that cannot travel to its workers, or a worker that fails to start.
    """
    pipeline = pipeline if pipeline is not None else last_pipeline()
    if not isinstance(pipeline, Pipeline) and not (
        isinstance(pipeline, Mapping) and pipeline and all(isinstance(p, Pipeline) for p in pipeline.values())
    ):
        raise ConfigError("deploy() serves a Pipeline, as `with patchkit.capture() as pipeline:` makes, or several by name "
                          f"({{'name': pipeline, ...}}); got {pipeline!r:.100}")
    DeploymentConfig.check_arguments(
        pipeline, DEPLOY_ARGUMENTS, replicas=replicas, batch_size=batch_size, plan=plan, backend=backend, slo_ms=slo_ms,
        host=host, port=port, ray_address=ray_address, **options,
    )
    if plan != "auto" and (resources is not None or calibration is not None or weights is not None):
        given = "resources=" if resources is not None else "calibration=" if calibration is not None else "weights="
        raise ConfigError(f"{given} is for planning: pass it with plan='auto' (got plan={plan!r:.60})")
    _check_calibration(pipeline, calibration)
    if backend == "ray":
        ray_address = _ray_address(ray_address)
        if plan == "auto" and resources is None:  # plan for the cluster, not for this machine
            from patchkit.orchestrator.ray_backend import cluster_resources

            resources = cluster_resources(ray_address)
    if plan == "auto":
        from patchkit.scheduler.offline.planner import plan as make_plan

        strictest = min(slo_ms.values(), default=None) if isinstance(slo_ms, Mapping) else slo_ms
        plan = make_plan(pipeline, resources=resources, calibration=calibration, weights=weights, slo_ms=strictest)
    config = DeploymentConfig.resolve(
        pipeline, replicas=replicas, batch_size=batch_size, plan=plan, backend=backend, slo_ms=slo_ms, host=host,
        port=port, secret=secrets.token_urlsafe(32), ray_address=ray_address, **options,
    )
    if backend == "inprocess":
        from patchkit.server.process import ServerThread

        thread = ServerThread(pipeline, config)
        return Endpoint(thread.start(), thread.close, timeout_s=config.liveness.request_timeout_s, headers=_auth_header(config),
                        updater=thread.update)
    return _deploy_local(pipeline, config)


# deploy()'s own parameters, besides the options of DeploymentConfig: what a misspelt name may be close to.
DEPLOY_ARGUMENTS = tuple(name for name, parameter in inspect.signature(deploy).parameters.items()
                         if parameter.kind is not inspect.Parameter.VAR_KEYWORD and name not in OPTIONS)

if deploy.__doc__ is not None:  # None under `python -OO`
    deploy.__doc__ += "\n    The options, by the group of `patchkit.config.DeploymentConfig` that holds each:\n\n" + reference(
        OPTIONS.values()) + "\n"


def _check_calibration(pipeline: Pipeline | Mapping[str, Pipeline], calibration: object) -> None:
    """A list of inputs, or for several pipelines a list of inputs by pipeline name."""
    def inputs_list(value: object) -> bool:
        return isinstance(value, Sequence) and not isinstance(value, str) and all(isinstance(v, Mapping) for v in value)

    if calibration is None:
        return
    if isinstance(pipeline, Pipeline) and not inputs_list(calibration):
        raise ConfigError(f"calibration must be a list of inputs, such as [{{'query': '...'}}]; got {calibration!r:.100}")
    if isinstance(pipeline, Mapping) and not (
        isinstance(calibration, Mapping) and set(calibration) <= set(pipeline) and all(map(inputs_list, calibration.values()))
    ):
        raise ConfigError("calibration of several pipelines is a list of inputs by pipeline name, such as "
                          f"{{'crag': [{{'query': '...'}}]}}; got {calibration!r:.100}")


def _auth_header(config: DeploymentConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.server.auth_token}"} if config.server.auth_token is not None else {}


def _ray_address(given: str | None) -> str | None:
    """The cluster a ray deployment's front-end joins: `given`, else the one this process is connected to."""
    if given is not None or "ray" not in sys.modules:
        return given
    import ray

    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


def _deploy_local(pipeline: Pipeline | Mapping[str, Pipeline], config: DeploymentConfig) -> Endpoint:
    """The front-end in a process of its own, which starts the workers (local) or the actors (ray).

    Updates travel to it over its private pipe.
    """
    import pickle

    from patchkit.orchestrator.process import spawn
    from patchkit.server.process import FrontendBootstrap

    boot = FrontendBootstrap(_payload(pipeline), config, list(sys.path))
    child = spawn("patchkit.server.process", pickle.dumps(boot), what="the front-end", timeout_s=envs.worker_start_timeout_s(),
                  messages=True)

    def close() -> None:
        if child.alive():
            child.process.terminate()  # SIGTERM: drain, stop the workers, exit
            try:  # with the lifeline open: cutting it makes the front-end exit at once, undrained
                child.process.wait(config.liveness.drain_timeout_s + envs.worker_stop_timeout_s() + 5)
            except subprocess.TimeoutExpired:
                pass
        child.stop(envs.worker_stop_timeout_s())

    def update(pipelines: dict[str, Pipeline], remove: list[str]) -> dict[str, dict[str, Any]]:
        message = _payload({"pipelines": pipelines, "remove": remove})
        versions: dict[str, dict[str, Any]] = child.ask(message, envs.worker_start_timeout_s() + OTHER_TIMEOUT_S)["pipelines"]
        return versions

    return Endpoint(child.report["url"], close, timeout_s=config.liveness.request_timeout_s, headers=_auth_header(config),
                    updater=update)


def _payload(pipelines: object) -> bytes:
    """Pipelines pickled for the front-end process (components travel as their specs)."""
    try:
        return cloudpickle.dumps(pipelines)
    except Exception as exc:
        raise PatchkitError(
            f"the pipeline cannot travel to its worker processes: {type(exc).__name__}: {exc}. Every component's "
            "constructor arguments must pickle (load unpicklable state in setup()), or deploy with backend='inprocess'"
        ) from exc
