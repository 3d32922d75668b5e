"""Runtime benchmarks: front-end overhead, one gRPC hop, three-stage throughput through local workers.

    python benchmarks/runtime.py [--seconds 10] [--json results.json]

Each number comes with its baseline from the same run (see benchmarks/README.md for results):
- overhead: three no-op components on the inprocess backend under 1,024 requests/s Poisson
  arrivals; the front-end's own per-request latency minus the same pipeline run eagerly, once with
  requests arriving over HTTP from a load-generator process (`python -m patchkit.bench`), once
  submitted on the front-end's own event loop (the scheduler alone, as Patchwork measures its
  scheduling latency);
- gRPC hop: one call with a 2 KB payload to a local worker and back, against a bare unary RPC
  on the same channel;
- throughput: the same pipeline through three worker processes, closed loop, with batching
  against batch size 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from aiohttp import web

import patchkit
from patchkit import Component, make
from patchkit.bench import BenchResult
from patchkit.config import DeploymentConfig
from patchkit.config.backends import make_backend
from patchkit.orchestrator.backend import ReplicaSpec
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.local import LocalBackend
from patchkit.orchestrator.rpc import HEALTH, SECRET_KEY
from patchkit.serving.frontend import Frontend


class Stage(Component):
    """A no-op batched component: what is left is patchkit's own cost."""

    def __init__(self, name: str) -> None:
        self.name = name

    @make(batch=True, max_batch_size=64, read_only=True)
    def run(self, text: list[str]) -> list[str]:
        return text


class Echo(Component):
    @make(read_only=True)
    def echo(self, payload: bytes) -> bytes:
        return payload


first, second, third = Stage("first"), Stage("second"), Stage("third")


def three_stages(query: str) -> patchkit.Pipeline:
    with patchkit.capture() as pipeline:
        a = first.run(query)
        b = second.run(a)
        return third.run(b)
    return pipeline  # not reached: the block returns; kept for type checkers


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def load(mode: str, url: str, level: float, seconds: float, body: str | None = None) -> dict:
    """Send load to `url` from `python -m patchkit.bench` in a process of its own, so that the load
    generator never shares the front-end's interpreter: mode "poisson" at `level` requests/s, or
    "closed", a closed loop of `level` clients. `body`: one request body or a JSON list of them.
    Returns sent, ok, errors, elapsed_s, and the client's and the server's latencies (ms) of the
    answered requests, from the run's `--json` records."""
    bodies = json.loads(body) if body else {"inputs": {"query": "What is a generator?"}}
    inputs = [one["inputs"] for one in (bodies if isinstance(bodies, list) else [bodies])]
    level_flag = ["--rate", str(level)] if mode == "poisson" else ["--concurrency", str(int(level))]
    # The load generator gets a core of its own where there are two, as if it ran on another machine.
    cores = sorted(os.sched_getaffinity(0))
    pin = ["taskset", "-c", str(cores[-1])] if len(cores) > 1 and shutil.which("taskset") else []
    with tempfile.TemporaryDirectory() as folder:
        inputs_file, out = Path(folder) / "inputs.jsonl", Path(folder) / "bench.json"
        inputs_file.write_text("".join(json.dumps(one) + "\n" for one in inputs))
        command = [*pin, sys.executable, "-m", "patchkit.bench", url, *level_flag, "--seconds", str(seconds),
                   "--inputs-file", str(inputs_file), "--json", str(out)]
        done = subprocess.run(command, capture_output=True, text=True)  # noqa: S603
        if done.returncode != 0:
            raise RuntimeError(f"the load generator failed ({done.returncode}): {done.stderr.strip()}")
        result = BenchResult.from_dict(json.loads(out.read_text()))
    answered = [r for r in result.requests if r.ok]
    return {
        "sent": len(result.requests),
        "ok": len(answered),
        "errors": len(result.requests) - len(answered),
        "elapsed_s": result.elapsed_s,
        "client_ms": [r.latency_ms for r in answered],
        "server_ms": [r.server_ms for r in answered if r.server_ms is not None],
    }


def eager_p50_ms(pipeline: patchkit.Pipeline) -> float:
    eager = []
    for _ in range(2000):
        start = time.perf_counter()
        pipeline(query="What is a generator?")
        eager.append((time.perf_counter() - start) * 1000)
    return statistics.median(eager)


def bench_overhead_http(pipeline: patchkit.Pipeline, seconds: float, eager_p50: float) -> dict:
    with patchkit.deploy(pipeline, backend="inprocess") as endpoint:
        result = load("poisson", endpoint.url, 1024, seconds)
    server, client = result["server_ms"], result["client_ms"]
    return {
        "offered_per_s": 1024,
        "answered": result["ok"],
        "errors": result["errors"],
        "added_p50_ms": percentile(server, 0.50) - eager_p50,
        "added_p99_ms": percentile(server, 0.99) - eager_p50,
        "http_round_trip_p50_ms": percentile(client, 0.50),
        "http_round_trip_p99_ms": percentile(client, 0.99),
    }


def bench_bare_http(seconds: float) -> dict:
    """The baseline for the HTTP numbers: an aiohttp server that answers at once, under the same load."""
    reply = b'{"output": "x", "request_id": 1, "latency_ms": 0.0}'

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=reply, content_type="application/json")

    async def healthy(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def serve(ready: threading.Event, stop: threading.Event, found: dict) -> None:
        app = web.Application()
        app.router.add_post("/v1/query", answer)
        app.router.add_get("/healthz", healthy)  # the load generator checks it before the run
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        found["url"] = f"http://127.0.0.1:{runner.addresses[0][1]}"
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await runner.cleanup()

    ready, stop, found = threading.Event(), threading.Event(), {}
    thread = threading.Thread(target=lambda: asyncio.run(serve(ready, stop, found)))
    thread.start()
    ready.wait()
    try:
        result = load("poisson", found["url"], 1024, seconds)
    finally:
        stop.set()
        thread.join()
    client = result["client_ms"]
    return {"http_round_trip_p50_ms": percentile(client, 0.5), "http_round_trip_p99_ms": percentile(client, 0.99)}


async def _poisson_on_the_loop(pipeline: patchkit.Pipeline, seconds: float) -> list[float]:
    config = DeploymentConfig.resolve(pipeline, backend="inprocess")
    frontend = Frontend(pipeline, config, make_backend(config))
    await frontend.start()
    rng, latencies, tasks = random.Random(0), [], set()

    async def one() -> None:
        result = await frontend.query({"query": "What is a generator?"})
        latencies.append(result.latency_s * 1000)

    start = next_at = time.perf_counter()
    while next_at - start < seconds:
        delay = next_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.ensure_future(one())
        tasks.add(task)
        task.add_done_callback(tasks.discard)
        next_at += rng.expovariate(1024)
    await asyncio.gather(*tasks)
    await frontend.close()
    return latencies


def bench_overhead_scheduler(pipeline: patchkit.Pipeline, seconds: float, eager_p50: float) -> dict:
    latencies = asyncio.run(_poisson_on_the_loop(pipeline, seconds))
    return {
        "offered_per_s": 1024,
        "answered": len(latencies),
        "added_p50_ms": percentile(latencies, 0.50) - eager_p50,
        "added_p99_ms": percentile(latencies, 0.99) - eager_p50,
    }


async def _hop(calls: int) -> dict:
    secret = secrets.token_urlsafe(16)
    backend = LocalBackend(secret)
    replica = await backend.start(ReplicaSpec("echo", Echo()), "echo#0")
    payload = bytes(range(256)) * 8  # 2 KB
    try:
        channel = replica.channel
        health = channel._channel.unary_unary(HEALTH)  # type: ignore[attr-defined]
        hop, bare = [], []
        for _ in range(calls):
            start = time.perf_counter()
            outcomes = await channel.run_batch("echo", [CallEnvelope((payload,), {})])
            hop.append((time.perf_counter() - start) * 1000)
            assert outcomes[0] == (True, payload)
            start = time.perf_counter()
            await health(b"", metadata=((SECRET_KEY, secret),))
            bare.append((time.perf_counter() - start) * 1000)
    finally:
        await backend.stop(replica)
    return {
        "payload_bytes": len(payload),
        "hop_p50_ms": percentile(hop, 0.5),
        "hop_p99_ms": percentile(hop, 0.99),
        "bare_unary_p50_ms": percentile(bare, 0.5),
        "ratio_to_bare_unary_p50": percentile(hop, 0.5) / percentile(bare, 0.5),
    }


def bench_throughput(pipeline: patchkit.Pipeline, seconds: float) -> dict:
    rows = {}
    for label, batch_size in (("batched", None), ("batch_size_1", 1)):
        with patchkit.deploy(pipeline, backend="local", batch_size=batch_size) as endpoint:
            load("closed", endpoint.url, 32, 2)  # warm up
            result = load("closed", endpoint.url, 256, seconds)
            stats = endpoint.stats()
        mean_batch = {n: c["methods"]["run"]["mean_batch"] for n, c in stats["components"].items()}
        rows[label] = {
            "requests_per_s": result["ok"] / result["elapsed_s"],
            "errors": result["errors"],
            "p50_ms": percentile(result["client_ms"], 0.5),
            "p99_ms": percentile(result["client_ms"], 0.99),
            "mean_batch": mean_batch,
        }
    rows["speedup_from_batching"] = rows["batched"]["requests_per_s"] / rows["batch_size_1"]["requests_per_s"]
    return rows


def arguments() -> argparse.Namespace:
    """`--seconds` of load per measurement, `--json FILE` to keep the results; shared by every benchmark."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None, help="where a benchmark that draws writes its PNG")
    return parser.parse_args()


def report(results: dict, json_path: str | None) -> None:
    text = json.dumps(results, indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text + "\n")


def main() -> None:
    args = arguments()
    pipeline = three_stages("What is a generator?") and patchkit.last_pipeline()
    eager_p50 = eager_p50_ms(pipeline)
    results = {
        "eager_p50_ms": eager_p50,
        "overhead_scheduler_1024rps": bench_overhead_scheduler(pipeline, args.seconds, eager_p50),
        "overhead_http_1024rps": bench_overhead_http(pipeline, args.seconds, eager_p50),
        "bare_aiohttp_1024rps": bench_bare_http(args.seconds),
        "grpc_hop_2kb": asyncio.run(_hop(2000)),
        "throughput_three_stages_local": bench_throughput(pipeline, args.seconds),
    }
    report(results, args.json)


if __name__ == "__main__":
    main()
