"""Async components: one replica of a component that waits 100 ms on I/O per call, many clients,
against the same component written with `time.sleep` on threads, in the same run.

    python benchmarks/async_components.py [--seconds 10] [--clients 512] [--rounds 3] [--json results.json]
        [--result benchmarks/results/async_components.json]

Each variant is deployed on the local backend (one worker process, one replica) and driven over HTTP
by a closed loop of `--clients` clients (aiohttp, in a process of its own pinned to the last core, as
if on another machine); every answer is checked against the value it must be. The variants:
- `async def` awaiting `asyncio.sleep(0.1)`, `max_concurrency=512`: its calls await together on the
  worker's event loop;
- `def` calling `time.sleep(0.1)`, `max_concurrency=64`: a thread per call in flight, 64 threads (as
  OpenAIGenerator ran before it was async);
- the same with `max_concurrency=512`: 512 threads;
- and, as the ceiling of the serving path on the machine of the run, the same answer with no wait at all.
The worker reports the most calls it ran at once, its thread count, and its CPU time per answered
request (from /proc, over the measured seconds). Each round runs every variant
once, in turn, each round starting from the next variant, so that a machine whose load changes weighs
on all of them; the summary is each variant's median over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import aiohttp
import provenance  # benchmarks/provenance.py: this script's directory is on sys.path

import patchkit
from patchkit import Component, make

PAUSE_S = 0.1


class AsyncIO(Component):
    """Waits PAUSE_S as a client awaiting a remote API does."""

    def setup(self) -> None:
        self.running = self.most = 0

    @make(max_concurrency=512)
    async def fetch(self, x: int) -> int:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(PAUSE_S)
        finally:
            self.running -= 1
        return 3 * x + 1

    def stats(self) -> dict[str, Any]:
        return {"most_at_once": self.most, "threads": threading.active_count()}


class ThreadedIO(Component):
    """The same wait with `time.sleep`, which holds a thread per call."""

    def setup(self) -> None:
        self.lock = threading.Lock()
        self.running = self.most = 0

    def _fetch(self, x: int) -> int:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        try:
            time.sleep(PAUSE_S)
        finally:
            with self.lock:
                self.running -= 1
        return 3 * x + 1

    def stats(self) -> dict[str, Any]:
        return {"most_at_once": self.most, "threads": threading.active_count()}


class Threaded64(ThreadedIO):
    @make(max_concurrency=64)
    def fetch(self, x: int) -> int:
        return self._fetch(x)


class Threaded512(ThreadedIO):
    @make(max_concurrency=512)
    def fetch(self, x: int) -> int:
        return self._fetch(x)


class NoWait(Component):
    """The same answer at once: what the front-end, the wire and the worker serve when nothing waits."""

    @make(max_concurrency=512)
    def fetch(self, x: int) -> int:
        return 3 * x + 1

    def stats(self) -> dict[str, Any]:
        return {"threads": threading.active_count()}


def fetching(component: Component) -> patchkit.Pipeline:
    x = 0
    with patchkit.capture(run=False) as pipeline:
        return component.fetch(x)  # type: ignore[attr-defined, no-any-return]
    return pipeline


async def closed_loop(url: str, clients: int, seconds: float) -> dict[str, Any]:
    """`clients` clients, each asking again as soon as it is answered, for `seconds`; every answer checked."""
    numbers = itertools.count()
    latencies: list[float] = []
    counts = {"right": 0, "wrong": 0, "errors": 0}
    stop = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop:
            x = next(numbers)
            started = time.perf_counter()
            try:
                async with session.post(url + "/v1/query", json={"inputs": {"x": x}}) as reply:
                    body = await reply.json()
            except (aiohttp.ClientError, TimeoutError):
                counts["errors"] += 1
                continue
            if reply.status != 200:
                counts["errors"] += 1
            elif body["output"] == 3 * x + 1:
                counts["right"] += 1
                latencies.append((time.perf_counter() - started) * 1000)
            else:
                counts["wrong"] += 1

    started = time.monotonic()
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    elapsed = time.monotonic() - started
    latencies.sort()
    return {
        **counts,
        "requests_per_s": counts["right"] / elapsed,
        "p50_ms": statistics.median(latencies) if latencies else None,
        "p99_ms": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
    }


def drive(url: str, clients: int, seconds: float) -> dict[str, Any]:
    """`closed_loop` in a process of its own (this script with --drive), pinned to the last core where there are two."""
    cores = sorted(os.sched_getaffinity(0))
    pin = ["taskset", "-c", str(cores[-1])] if len(cores) > 1 and shutil.which("taskset") else []
    command = [*pin, sys.executable, __file__, "--drive", url, "--clients", str(clients), "--seconds", str(seconds)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def cpu_s(pid: int) -> float:
    """The CPU seconds (user and system) process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(component: Component, clients: int, seconds: float) -> dict[str, Any]:
    with patchkit.deploy(fetching(component), backend="local") as endpoint:
        drive(endpoint.url, clients, 1.0)  # warm up: connections, the worker's pools
        [report] = endpoint.stats()["replica_reports"].values()
        before = cpu_s(report["pid"])
        result = drive(endpoint.url, clients, seconds)
        used = cpu_s(report["pid"]) - before
        [report] = endpoint.stats()["replica_reports"].values()
    per_request = used * 1000 / result["right"] if result["right"] else None
    return {**result, "worker": {**report["component_stats"], "cpu_ms_per_request": per_request}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--drive", default=None, help="be the clients of the endpoint at this URL, print the result")
    parser.add_argument("--result", default=None, help="write a result file for the site (benchmarks/results/)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    if args.drive:
        print(json.dumps(asyncio.run(closed_loop(args.drive, args.clients, args.seconds))))
        return
    results: dict[str, Any] = {"clients": args.clients, "seconds": args.seconds, "pause_s": PAUSE_S, "runs": {}}
    variants = {"async_512": AsyncIO, "threads_64": Threaded64, "threads_512": Threaded512, "no_wait": NoWait}
    for round_ in range(args.rounds):
        order = list(variants.items())
        for label, kind in order[round_ % len(order) :] + order[: round_ % len(order)]:  # each round starts elsewhere
            run = measure(kind(), args.clients, args.seconds)
            results["runs"].setdefault(label, []).append(run)
            print(round_, label, json.dumps(run), flush=True)
    median = {label: statistics.median(r["requests_per_s"] for r in runs) for label, runs in results["runs"].items()}
    results["median_requests_per_s"] = median
    results["all_right"] = all(r["wrong"] == 0 and r["errors"] == 0 for runs in results["runs"].values() for r in runs)
    results["async_over_threads_64"] = median["async_512"] / median["threads_64"]
    results["async_over_threads_512"] = median["async_512"] / median["threads_512"]
    results["async_over_no_wait"] = median["async_512"] / median["no_wait"]
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    if args.result:
        provenance.write(args.result, result_file(results, args.rounds, load_before))


LABELS = {"async_512": "`async def`, `max_concurrency=512`",
          "threads_64": "`time.sleep` on threads, `max_concurrency=64` (the baseline)",
          "threads_512": "`time.sleep` on threads, `max_concurrency=512`",
          "no_wait": "no wait (the serving path's ceiling here)"}


def result_file(results: dict[str, Any], rounds: int, load_before: float) -> dict[str, Any]:
    """The run as a result file: each variant's rounds and median, and a plot of the medians."""
    rows = []
    for label, runs in results["runs"].items():
        rates = [run["requests_per_s"] for run in runs]
        middle = sorted(runs, key=lambda run: run["requests_per_s"])[len(runs) // 2]
        latency = (f"{middle['p50_ms']:,.0f} / {middle['p99_ms']:,.0f}" if middle["p50_ms"] is not None else "-")
        wrong = sum(run["wrong"] + run["errors"] for run in runs)
        rows.append([LABELS[label], ", ".join(f"{rate:,.0f}" for rate in rates),
                     f"{results['median_requests_per_s'][label]:,.0f}", latency, str(wrong)])
    return provenance.result_file(
        title="Async components: one replica awaiting 100 ms, many clients, against threads",
        components="simulated", load_before=load_before,
        setup=f"One replica (local backend) of a component whose call waits 100 ms, in four variants deployed one "
              f"after another, driven over HTTP by a closed loop of {results['clients']} clients (aiohttp, a process "
              f"of its own) for {results['seconds']:g} s each; {rounds} round(s), each starting from the next "
              "variant; every answer checked. The serving path shares the machine's cores with the clients.",
        tables=[{"caption": "Requests per second each round and their median; latency of the median round; "
                            "wrong answers and errors over every round.",
                 "columns": ["variant", "requests/s, each round", "median", "p50 / p99 latency (ms)",
                             "wrong or failed"],
                 "rows": rows}],
        plots=[{"title": "Median requests per second", "kind": "barh", "xlabel": "requests/s",
                "x": [LABELS[label].replace("`", "") for label in results["runs"]],
                "series": {"median": [round(results["median_requests_per_s"][label], 1)
                                      for label in results["runs"]]}}],
        raw=results)


if __name__ == "__main__":
    main()
