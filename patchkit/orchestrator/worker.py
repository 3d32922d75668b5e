"""The worker process: one replica of one component, served over gRPC.

Started by the local backend as `python -m patchkit.orchestrator.worker` (see `process.py` for the
bootstrap and lifeline). It pins its resources, rebuilds the component from its spec, runs
`setup()` once, starts the gRPC server on the bootstrap's host with a free port, and reports
`{"port", "pid"}`. It exits when its parent closes the lifeline or dies.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from patchkit.client.component import Component, ensure_setup
from patchkit.errors import MakeError
from patchkit.orchestrator.execute import setup_error
from patchkit.orchestrator.process import ChildSide
from patchkit.orchestrator.resources import ReplicaResources
from patchkit.orchestrator.rpc import SERVER_OPTIONS, WorkerService

__all__ = ["WorkerBootstrap", "main"]

logger = logging.getLogger(__name__)


@dataclass
class WorkerBootstrap:
    """What a worker needs to start; written by the local backend, read by `main`."""

    name: str
    component: bytes  # cloudpickled Component: its spec only, unpickled after the resources are pinned
    secret: str
    resources: ReplicaResources = field(default_factory=ReplicaResources)
    host: str = "127.0.0.1"
    sys_path: list[str] = field(default_factory=list)


def main() -> None:
    side = ChildSide()
    boot: WorkerBootstrap = pickle.loads(side.bootstrap())  # noqa: S301 - from our parent, over a private pipe
    side.watch_lifeline()
    sys.path[:] = boot.sys_path or sys.path
    boot.resources.pin()
    try:
        component = pickle.loads(boot.component)  # noqa: S301 - ditto
        if not isinstance(component, Component):
            raise MakeError(f"worker {boot.name}: expected a Component, got {type(component).__name__}")
        ensure_setup(component)
    except BaseException as exc:
        logger.exception("worker %s failed to start", boot.name)
        side.failed(setup_error(boot.name, exc))
        os._exit(1)
    service = WorkerService(component, boot.name, boot.secret, lambda: _describe(boot.resources))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="patchkit-rpc"), options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((service.handler(),))
    port = server.add_insecure_port(f"{boot.host}:0")
    server.start()
    side.ready(port=port, pid=os.getpid())
    threading.Event().wait()  # serve until the lifeline ends the process


def _describe(resources: ReplicaResources) -> dict[str, Any]:
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {
        "pid": os.getpid(),
        "affinity": affinity,
        "threads": os.environ.get("OMP_NUM_THREADS"),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "resources": resources.describe(),
    }


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s worker %(process)d: %(message)s")
    main()
