"""`deploy()`: the options checked, a plan made where asked, and the front-end process started.

With the inprocess backend, a thread of this process instead. It returns the `Endpoint` that talks to it (`endpoint.py`).
"""

from __future__ import annotations

import inspect
import secrets
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import cloudpickle

from patchkit import envs
from patchkit.client.endpoint import OTHER_TIMEOUT_S, Endpoint
from patchkit.config import OPTIONS, DeploymentConfig
from patchkit.config.options import reference
from patchkit.errors import ConfigError, PatchkitError
from patchkit.program.pipeline import Pipeline, last_pipeline, stamp

if TYPE_CHECKING:
    from patchkit.scheduler.offline.plan import Plan

__all__ = ["DEPLOY_ARGUMENTS", "deploy"]

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
    stamp(pipeline)  # their versions, computed here where their code is: the front-end compares them
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
