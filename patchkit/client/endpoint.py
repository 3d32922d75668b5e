"""`deploy()` and the `Endpoint` it returns: the user's handle on a served pipeline."""

from __future__ import annotations

import http.client
import json
import secrets
import subprocess
import sys
import threading
import urllib.parse
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle

from patchkit import envs
from patchkit.client.pipeline import Pipeline, last_pipeline
from patchkit.errors import ConfigError, PatchkitError, error_from_json

if TYPE_CHECKING:
    from patchkit.config import DeploymentConfig
    from patchkit.scheduler.offline.plan import Plan
    from patchkit.scheduler.online.traces import Trace

__all__ = ["Endpoint", "deploy"]

# deploy()'s own parameters, besides the options of DeploymentConfig: what a misspelt name may be close to.
DEPLOY_ARGUMENTS = ("pipeline", "resources", "calibration")


class Endpoint:
    """A deployed pipeline: `url`, `query(**inputs)`, `await aquery(**inputs)`, `stats()`, `close()`.

    Also a context manager; whatever is still open closes when the interpreter exits.
    """

    def __init__(self, url: str, closer: Callable[[], None]) -> None:
        self.url = url
        parts = urllib.parse.urlsplit(url)
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port or 80
        self._local = threading.local()
        self._connections: list[http.client.HTTPConnection] = []  # every thread's, closed by close()
        self._lock = threading.Lock()
        self._closer: Callable[[], None] | None = closer
        self._finalizer = weakref.finalize(self, closer)  # also runs at interpreter exit

    # -- requests -------------------------------------------------------------------------------
    def query(self, **inputs: Any) -> Any:
        """Run the pipeline on `inputs` and return its output; raises the error the endpoint answered."""
        return self._reply(*self._request("POST", "/v1/query", {"inputs": inputs}))["output"]

    async def aquery(self, **inputs: Any) -> Any:
        """`query` for asyncio code: thousands may wait at once on one event loop."""
        import aiohttp

        async with aiohttp.ClientSession() as session:
            async with session.post(self.url + "/v1/query", json={"inputs": inputs}) as response:
                return self._reply(response.status, await response.read())["output"]

    def stats(self) -> dict[str, Any]:
        """Per component: replicas, batch sizes, throughput, queue lengths; and request counts."""
        result: dict[str, Any] = self._reply(*self._request("GET", "/v1/stats?replicas=1", None))
        return result

    def plan(self) -> dict[str, Any]:
        """What `GET /v1/plan` serves: per component its replicas and batch sizes, and the Plan applied, if any."""
        result: dict[str, Any] = self._reply(*self._request("GET", "/v1/plan", None))
        return result

    def traces(self) -> list[Trace]:
        """The last finished requests with an SLO (up to 5,000), each call with its times and queue
        wait: what the SLO estimators learn from, for `patchkit.scheduler.online.estimator.accuracy`."""
        from patchkit.scheduler.online.traces import Trace

        result: dict[str, Any] = self._reply(*self._request("GET", "/v1/traces", None))
        return [Trace.from_dict(trace) for trace in result["traces"]]

    def _request(self, method: str, path: str, payload: Any) -> tuple[int, bytes]:
        if self._closer is None:
            raise PatchkitError(f"the endpoint at {self.url} is closed")
        body = None if payload is None else json.dumps(payload).encode()
        while True:
            connection = self._connection()
            reused = connection.sock is not None
            try:
                connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
                response = connection.getresponse()
                return response.status, response.read()
            except (ConnectionError, http.client.HTTPException) as exc:
                connection.close()
                self._local.connection = None
                # Only a kept-alive connection that the server had already closed is tried again: the
                # request never reached it. Anything else may have run, and is reported, not repeated.
                stale = isinstance(exc, (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError))
                if not (reused and stale):
                    raise

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = http.client.HTTPConnection(self._host, self._port, timeout=None)
            with self._lock:
                self._connections.append(connection)
        return connection

    @staticmethod
    def _reply(status: int, body: bytes) -> Any:
        data = json.loads(body)
        if status >= 400:
            raise error_from_json(data.get("error", {"message": body.decode(errors="replace")}))
        return data

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Drain in-flight requests, stop every worker and the front-end; nothing is left running."""
        if self._closer is not None:
            self._closer = None
            self._finalizer()
            with self._lock:
                connections, self._connections = self._connections, []
            for connection in connections:
                connection.close()

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Endpoint {self.url}{' closed' if self._closer is None else ''}>"


def deploy(
    pipeline: Pipeline | None = None,
    *,
    backend: str = "local",
    slo_ms: float | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    replicas: int | Mapping[str, int] | None = None,
    batch_size: int | Mapping[str, int] | None = None,
    plan: Plan | str | None = None,
    resources: Mapping[str, int] | None = None,
    calibration: Sequence[Mapping[str, Any]] | None = None,
    ray_address: str | None = None,
    **options: Any,
) -> Endpoint:
    """Serve `pipeline` (default: the last one captured) and return its Endpoint once every worker is ready.

    `backend`: "local" (a front-end process and one worker process per replica) or "inprocess"
    (a thread of this process running your own component objects, for tests and pdb) or "ray" (one
    Ray actor per replica, placed across a Ray cluster: `ray_address` names it; default: the cluster
    this process is connected to, else the one `RAY_ADDRESS` names, else a local Ray instance started
    for the deployment; further options ray_max_restarts, ray_placement_timeout_s, ray_actor_options,
    tls (on: a certificate made for the deployment unless tls_cert, tls_key, tls_ca, tls_server_name
    name one; tls=False sends in plaintext)). `replicas`: a count for every component, or
    counts by component name; `batch_size`: a size for every method, or sizes by component or
    "component.method" (default: each method's `@make(max_batch_size=...)`). `plan`: a `Plan` to
    apply, or "auto" to make one first with `patchkit.plan(pipeline, resources=, calibration=,
    slo_ms=)`: it sets every component's replicas, batch size and placement. Further options are
    the fields of `patchkit.config.DeploymentConfig` (batch_wait_ms, optional_inputs,
    max_inflight_requests, max_body_bytes, request_timeout_s, max_retries, drain_timeout_s, log_level,
    the SLO policies' prioritize, pause_admission, autoscale, min_replicas, max_replicas).

    Every argument is checked before anything is planned or started: a ConfigError names an unknown
    option (with the closest known name), a value out of range, or two options that conflict.
    """
    from patchkit.config import DeploymentConfig

    pipeline = pipeline if pipeline is not None else last_pipeline()
    if not isinstance(pipeline, Pipeline):
        raise ConfigError(f"deploy() serves a Pipeline, as `with patchkit.capture() as pipeline:` makes; got {pipeline!r:.100}")
    DeploymentConfig.check_arguments(
        pipeline, DEPLOY_ARGUMENTS, replicas=replicas, batch_size=batch_size, plan=plan, backend=backend, slo_ms=slo_ms,
        host=host, port=port, ray_address=ray_address, **options,
    )
    if plan != "auto" and (resources is not None or calibration is not None):
        given = "resources=" if resources is not None else "calibration="
        raise ConfigError(f"{given} is for planning: pass it with plan='auto' (got plan={plan!r:.60})")
    if calibration is not None and (
        isinstance(calibration, (str, Mapping)) or not all(isinstance(inputs, Mapping) for inputs in calibration)
    ):
        raise ConfigError(f"calibration must be a list of inputs, such as [{{'query': '...'}}]; got {calibration!r:.100}")
    if backend == "ray":
        ray_address = _ray_address(ray_address)
        if plan == "auto" and resources is None:  # plan for the cluster, not for this machine
            from patchkit.orchestrator.ray_backend import cluster_resources

            resources = cluster_resources(ray_address)
    if plan == "auto":
        from patchkit.scheduler.offline.planner import plan as make_plan

        plan = make_plan(pipeline, resources=resources, calibration=calibration, slo_ms=slo_ms)
    config = DeploymentConfig.resolve(
        pipeline, replicas=replicas, batch_size=batch_size, plan=plan, backend=backend, slo_ms=slo_ms, host=host,
        port=port, secret=secrets.token_urlsafe(32), ray_address=ray_address, **options,
    )
    if backend == "inprocess":
        from patchkit.server.process import ServerThread

        thread = ServerThread(pipeline, config)
        return Endpoint(thread.start(), thread.close)
    return _deploy_local(pipeline, config)


def _ray_address(given: str | None) -> str | None:
    """The cluster a ray deployment's front-end joins: `given`, else the one this process is connected to."""
    if given is not None or "ray" not in sys.modules:
        return given
    import ray

    return ray.get_runtime_context().gcs_address if ray.is_initialized() else None


def _deploy_local(pipeline: Pipeline, config: DeploymentConfig) -> Endpoint:
    """The front-end in a process of its own, which starts the workers (local) or the actors (ray)."""
    import pickle

    from patchkit.orchestrator.process import spawn
    from patchkit.server.process import FrontendBootstrap

    try:
        payload = cloudpickle.dumps(pipeline)
    except Exception as exc:
        raise PatchkitError(
            f"the pipeline cannot travel to its worker processes: {type(exc).__name__}: {exc}. Every component's "
            "constructor arguments must pickle (load unpicklable state in setup()), or deploy with backend='inprocess'"
        ) from exc
    boot = FrontendBootstrap(payload, config, list(sys.path))
    child = spawn("patchkit.server.process", pickle.dumps(boot), what="the front-end", timeout_s=envs.worker_start_timeout_s())

    def close() -> None:
        if child.alive():
            child.process.terminate()  # SIGTERM: drain, stop the workers, exit
            try:  # with the lifeline open: cutting it makes the front-end exit at once, undrained
                child.process.wait(config.drain_timeout_s + envs.worker_stop_timeout_s() + 5)
            except subprocess.TimeoutExpired:
                pass
        child.stop(envs.worker_stop_timeout_s())

    return Endpoint(child.report["url"], close)
