"""The replica's side on a Ray cluster: an actor hosting the same gRPC worker as the local backend.

The `ray` backend wraps `ReplicaActor` with `ray.remote` and asks Ray for the replica's resources;
Ray places it on a node and sets its `CUDA_VISIBLE_DEVICES`. `start()` then rebuilds the component,
runs `setup()`, and serves it as a worker process does (`worker.serve_replica`), but on the node's
cluster address (beyond loopback, so every call carries the deployment's secret; over TLS when
configured). When Ray restarts the actor after a crash, its constructor runs again with the same
bootstrap and `start()` serves anew.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from patchkit.errors import ComponentError, error_to_json
from patchkit.orchestrator.worker import WorkerBootstrap, serve_replica

__all__ = ["KEEPALIVE_CHANNEL_OPTIONS", "ReplicaActor"]

# Across a network a node can vanish without closing its connections: the front-end pings each worker's
# stream, so that a dead node's replicas are taken out of dispatch within seconds, not at the next timeout.
KEEPALIVE_S = 10
KEEPALIVE_CHANNEL_OPTIONS = (
    ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_S * 1000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
KEEPALIVE_SERVER_OPTIONS = (  # accept those pings on an idle stream rather than answer them with GOAWAY
    ("grpc.http2.min_recv_ping_interval_without_data_ms", KEEPALIVE_S * 1000 // 2),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)


class ReplicaActor:
    """One replica in one Ray actor. Methods are called by the ray backend, one at a time."""

    def __init__(self, boot: WorkerBootstrap) -> None:
        self._boot = boot
        self._server: Any = None
        self._report: dict[str, Any] | None = None

    def node(self) -> dict[str, Any]:
        """Answers as soon as Ray has placed the actor: the backend's placement check."""
        import ray

        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address()}

    def start(self) -> dict[str, Any]:
        """Build the component, run its `setup()`, serve it; `{"address", "pid", "node_ip"}` or `{"error"}`.

        Idempotent: a second call answers the first one's address.
        """
        if self._report is not None:
            return self._report
        import ray

        boot = self._boot
        # The front-end's paths, for what exists on this node too.
        sys.path.extend(p for p in boot.sys_path if p not in sys.path and os.path.isdir(p))
        host = ray.util.get_node_ip_address()  # the address Ray's own nodes reach this one at
        try:
            self._server, port = serve_replica(boot, host, KEEPALIVE_SERVER_OPTIONS)
        except ComponentError as exc:
            return {"error": error_to_json(exc)}
        self._report = {"address": f"[{host}]:{port}" if ":" in host else f"{host}:{port}", "pid": os.getpid(),
                        "node_ip": host}
        return self._report
