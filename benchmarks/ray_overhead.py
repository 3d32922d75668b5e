"""Per-call overhead of the ray backend against the local backend, on one machine.

    python benchmarks/ray_overhead.py [--calls 2000] [--json results.json]

Starts a local Ray instance (4 CPUs, on loopback, its files in a temporary directory) and measures,
each against the local backend in the same run:
- one batch hop: a 2 KB call to one replica and back on its gRPC stream, sequentially (the local
  backend's worker subprocess; the Ray actor hosting the same worker; the Ray actor over TLS);
  for scale, the same call as a plain Ray actor method call (`ray.get(actor.echo.remote(...))`),
  the path the data plane does not take;
- a request end to end: `endpoint.query` of a one-component pipeline over HTTP, sequentially;
- start-up: `deploy()` of three replicas until the endpoint answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import patchkit
from patchkit import Component, make
from patchkit.orchestrator.backend import Backend, ReplicaSpec
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.local import LocalBackend
from patchkit.orchestrator.ray_backend import RayBackend
from patchkit.orchestrator.ray_options import RayOptions


class Echo(Component):
    @make
    def echo(self, payload: bytes) -> bytes:
        return payload


def _summary(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    return {
        "p50_ms": 1000 * statistics.median(ordered),
        "p99_ms": 1000 * ordered[int(0.99 * (len(ordered) - 1))],
        "mean_ms": 1000 * statistics.fmean(ordered),
    }


async def _hop(backend: Backend, calls: int) -> dict[str, float]:
    payload = os.urandom(2048)
    replica = await backend.start(ReplicaSpec("echo", Echo()), "echo#0")
    try:
        for _ in range(50):  # warm the channel
            await replica.channel.run_batch("echo", [CallEnvelope((payload,), {})])
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            [(ok, value)] = await replica.channel.run_batch("echo", [CallEnvelope((payload,), {})])
            samples.append(time.perf_counter() - start)
            assert ok and value == payload
        return _summary(samples)
    finally:
        await backend.stop(replica)
        await backend.close()


def _ray_actor_call(calls: int) -> dict[str, float]:
    import ray

    actor = ray.remote(num_cpus=1)(EchoActor).remote()
    payload = os.urandom(2048)
    for _ in range(50):
        ray.get(actor.echo.remote(payload))
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        assert ray.get(actor.echo.remote(payload)) == payload
        samples.append(time.perf_counter() - start)
    ray.kill(actor)
    return _summary(samples)


class EchoActor:
    def echo(self, payload: bytes) -> bytes:
        return payload


def _pipeline() -> patchkit.Pipeline:
    echo = Echo()
    payload = "x"
    with patchkit.capture(run=False) as pipeline:
        answer = echo.echo(payload)  # noqa: F841 - the block's output
    return pipeline


def _end_to_end(calls: int, **deploy: Any) -> dict[str, float]:
    with patchkit.deploy(_pipeline(), autoscale=False, **deploy) as endpoint:
        for _ in range(50):
            endpoint.query(payload="warm")
        samples = []
        for i in range(calls):
            start = time.perf_counter()
            endpoint.query(payload=f"q{i}")
            samples.append(time.perf_counter() - start)
    return _summary(samples)


def _startup(**deploy: Any) -> float:
    start = time.perf_counter()
    with patchkit.deploy(_pipeline(), replicas=3, autoscale=False, **deploy) as endpoint:
        endpoint.query(payload="up")
        return time.perf_counter() - start


def _self_signed(directory: Path) -> tuple[str, str]:
    cert, key = directory / "worker.pem", directory / "worker.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=patchkit-worker",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


def _start_ray(tmp: Path) -> str:
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(16))
    os.environ.update(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token),
                      RAY_USAGE_STATS_ENABLED="0")
    import ray  # after the variables above: Ray reads some of them once, at import

    ray.init(num_cpus=4, _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=str(tmp / "r"),
             configure_logging=False, log_to_driver=False)
    address: str = ray.get_runtime_context().gcs_address
    return address


def run(calls: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="patchkit-ray-") as name:
        tmp = Path(name)
        address = _start_ray(tmp)
        cert, key = _self_signed(tmp)
        secret = secrets.token_urlsafe(32)
        measure: dict[str, Callable[[], Any]] = {
            "hop_local": lambda: asyncio.run(_hop(LocalBackend(secret), calls)),
            "hop_ray": lambda: asyncio.run(_hop(RayBackend(secret, RayOptions(address=address)), calls)),
            "hop_ray_tls": lambda: asyncio.run(_hop(RayBackend(secret, RayOptions(
                address=address, tls_cert=cert, tls_key=key, tls_server_name="patchkit-worker")), calls)),
            "ray_actor_call": lambda: _ray_actor_call(calls),
            "query_local": lambda: _end_to_end(calls, backend="local"),
            "query_ray": lambda: _end_to_end(calls, backend="ray", ray_address=address),
            "startup_local_s": lambda: _startup(backend="local"),
            "startup_ray_s": lambda: _startup(backend="ray", ray_address=address),
        }
        try:
            for label, fn in measure.items():
                results[label] = fn()
                print(f"{label}: {results[label]}", flush=True)
        finally:
            import ray

            ray.shutdown()
    results["hop_ray_over_local_p50"] = results["hop_ray"]["p50_ms"] / results["hop_local"]["p50_ms"]
    results["query_ray_over_local_p50"] = results["query_ray"]["p50_ms"] / results["query_local"]["p50_ms"]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = run(args.calls)
    print(json.dumps({k: v for k, v in results.items()}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    sys.exit(main())
