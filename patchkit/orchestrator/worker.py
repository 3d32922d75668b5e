"""The worker process: one replica of one component, served over gRPC.

Started by the local backend as `python -m patchkit.orchestrator.worker` (see `process.py` for the
bootstrap and lifeline). It pins its resources, rebuilds the component from its spec, runs
`setup()` once, starts the gRPC server on the bootstrap's host with a free port, and reports
`{"port", "pid"}`. It exits when its parent closes the lifeline or dies.

`serve_replica` is that start, shared with the Ray actor (`ray_actor.py`), which hosts the same
server; `WorkerBootstrap` is what both are given.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import grpc

from patchkit import telemetry
from patchkit.core import CallHook, Component, ensure_setup
from patchkit.errors import ComponentError, MakeError
from patchkit.orchestrator.backend import ReplicaSpec
from patchkit.orchestrator.execute import setup_error
from patchkit.orchestrator.handles import Handles
from patchkit.orchestrator.process import ChildSide
from patchkit.orchestrator.resources import ReplicaResources
from patchkit.orchestrator.rpc import SERVER_OPTIONS
from patchkit.orchestrator.service import WorkerService

__all__ = ["WorkerBootstrap", "describe", "load_component", "main", "serve_replica", "start_server"]

logger = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s worker %(process)d %(name)s: %(message)s"


@dataclass
class WorkerBootstrap:
    """What a replica needs to start: built by the local backend for a worker process (read by `main`),
    by the ray backend for an actor (kept by Ray for restarts, read by `ReplicaActor.start`)."""

    name: str
    component: bytes  # cloudpickled Component: its spec only, unpickled after the resources are pinned
    secret: str
    resources: ReplicaResources = field(default_factory=ReplicaResources)
    host: str = "127.0.0.1"  # where a worker process serves; an actor serves on its node's cluster address
    tls: tuple[bytes, bytes] | None = None  # the server's certificate and key, PEM
    sys_path: list[str] = field(default_factory=list)  # the front-end's
    log_level: int = logging.WARNING  # the front-end's, as its user configured it
    handles: Handles | None = None  # the components it holds that are deployed on their own
    batch_sizes: dict[str, int] | None = None  # told to its component before setup (`Component.serve_sizes`)

    @classmethod
    def of(
        cls, spec: ReplicaSpec, secret: str, *, host: str = "127.0.0.1", tls: tuple[bytes, bytes] | None = None
    ) -> WorkerBootstrap:
        """The bootstrap of a replica of `spec`, with the calling backend's `sys.path` and log level."""
        level = logging.getLogger("patchkit").getEffectiveLevel()
        component = cloudpickle.dumps(spec.instance)
        return cls(spec.component, component, secret, spec.resources, host, tls, list(sys.path), level, spec.handles,
                   spec.batch_sizes)


def main() -> None:
    side = ChildSide()
    boot = side.start(WorkerBootstrap)
    logging.basicConfig(level=boot.log_level, format=LOG_FORMAT, force=True)
    try:
        _, port = serve_replica(boot, boot.host)
    except ComponentError as exc:
        side.failed(exc)
        os._exit(1)
    side.ready(port=port, pid=os.getpid())
    threading.Event().wait()  # serve until the lifeline ends the process


def serve_replica(boot: WorkerBootstrap, host: str, options: Sequence[tuple[str, Any]] = ()) -> tuple[grpc.Server, int]:
    """Pin the replica's resources, rebuild its component, run `setup()`, and serve it on `host` with a free port.

    Called once per replica by the worker process's `main` and by the Ray actor's `start()`, each
    after taking its `sys.path` from the bootstrap. Returns the started server and its port. Raises
    the ComponentError of `setup_error` (logged here) when the build or `setup()` raised; an error
    starting the server is raised as it is.
    """
    boot.resources.pin()
    logging.getLogger("patchkit").setLevel(boot.log_level)  # in a Ray actor too, whose logging Ray set up
    telemetry.configure_from_env()  # export execution spans where the OTEL_* variables say so
    try:
        component, hook = load_component(boot)
    except BaseException as exc:
        logger.exception("replica of %s failed to start", boot.name)
        raise setup_error(boot.name, exc) from exc
    service = WorkerService(component, boot.name, boot.secret, lambda: describe(boot.resources), hook)
    return start_server(service, host, boot.tls, options)


def load_component(boot: WorkerBootstrap) -> tuple[Component, CallHook | None]:
    """Rebuild a replica's component from its cloudpickled spec, tell it its batch sizes and run its
    `setup()`, the components it holds that are deployed on their own left unloaded; returns it with
    the hook its calls of those go through (None: it holds none).

    Called once per replica by the worker process and by the Ray actor, after the resources are
    pinned; raises whatever the component's build or setup raised.
    """
    component = pickle.loads(boot.component)  # noqa: S301 - from the front-end of this deployment, over a private channel
    if not isinstance(component, Component):
        raise MakeError(f"worker {boot.name}: expected a Component, got {type(component).__name__}")
    hook = boot.handles.hook(component, boot.secret) if boot.handles is not None else None
    if boot.batch_sizes is not None:
        component.serve_sizes(boot.batch_sizes)
    ensure_setup(component)
    return component, hook


def start_server(
    service: WorkerService, host: str, tls: tuple[bytes, bytes] | None = None, options: Sequence[tuple[str, Any]] = ()
) -> tuple[grpc.Server, int]:
    """Serve `service` on `host` with a free port; over TLS when `tls` gives (certificate, key) PEM bytes.
    `options`: further gRPC server options.

    Returns the started server and its port. Called by the worker process and the Ray actor.
    """
    executor = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="patchkit-rpc")
    server = grpc.server(executor, options=[*SERVER_OPTIONS, *options])
    server.add_generic_rpc_handlers((service.handler(),))
    if tls is None:
        port = server.add_insecure_port(f"{host}:0")
    else:
        certificate, key = tls
        port = server.add_secure_port(f"{host}:0", grpc.ssl_server_credentials([(key, certificate)]))
    server.start()
    return server, port


def describe(resources: ReplicaResources) -> dict[str, Any]:
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "pid": os.getpid(),
        "affinity": affinity,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "resources": resources.describe(),
    }


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)  # until the bootstrap gives the level
    main()
