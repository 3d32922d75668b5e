"""Latency while a served pipeline is updated, against steady state, and against closing and deploying again.

A two-stage pipeline (an embedder-like stage that runs ~2 ms a batch, then a generator-like stage that runs
~5 ms a batch) serves an open-loop Poisson load on the default backend (local worker processes). Midway,
`endpoint.update()` swaps in a new version whose second stage has a new constructor argument (new workers,
started and warmed before the switch) and whose code after the call differs; the first stage is unchanged
(its workers kept). The baseline, in the same run: the same load while the user's other option is taken,
`close()` and `deploy()` of the new version (every request in that gap fails or waits).

    python benchmarks/update_latency.py --rate 50 --seconds 6 --json update.json --result benchmarks/results/update.json

Reports p50/p99 latency of the requests sent in steady state and in the update's window (from the call of
`update()` until 1 s after it returned), the time `update()` took, the time from its call to the first answer
of the new version, failed requests, and the same for the redeploy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import provenance  # benchmarks/provenance.py: this script's directory is on sys.path

import patchkit
from patchkit import Component, make


class Stage(Component):
    """Sleeps `ms` a batch (a model's batched forward pass stands in), and tags what it returns."""

    def __init__(self, tag: str, ms: float) -> None:
        self.tag, self.ms = tag, ms

    @make(batch=True, max_batch_size=32, read_only=True)
    def run(self, texts: list[str]) -> list[str]:
        time.sleep(self.ms / 1000)
        return [f"{text}|{self.tag}" for text in texts]


embed = Stage("embed", 2.0)


def version_one(text: str) -> Any:
    generate = Stage("v1", 5.0)
    with patchkit.capture():
        return generate.run(embed.run(text)).upper()


def version_two(text: str) -> Any:
    generate = Stage("v2", 5.0)
    with patchkit.capture():
        return generate.run(embed.run(text)).lower()


@dataclass
class Record:
    sent: float
    latency_s: float | None  # None: failed
    new: bool


@dataclass
class Load:
    """An open-loop Poisson load on one thread's event loop: each request sent at its time, whatever came back."""

    url: str
    rate: float
    records: list[Record] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        asyncio.run(self._run())

    async def _run(self) -> None:
        rng = random.Random(7)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
        async with httpx.AsyncClient(base_url=self.url, timeout=30, limits=limits) as client:
            tasks, at, n = [], time.monotonic(), 0
            while not self.stop.is_set():
                at += rng.expovariate(self.rate)
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                tasks.append(asyncio.create_task(self._one(client, f"q{n}")))
                n += 1
            await asyncio.gather(*tasks)

    async def _one(self, client: httpx.AsyncClient, text: str) -> None:
        sent = time.monotonic()
        try:
            reply = await client.post("/v1/query", json={"inputs": {"text": text}})
            ok = reply.status_code == 200
            output = reply.json().get("output", "") if ok else ""
        except httpx.HTTPError:
            ok, output = False, ""
        self.records.append(Record(sent, time.monotonic() - sent if ok else None, output.endswith("|v2")))


def percentiles(latencies: list[float]) -> dict[str, float]:
    if not latencies:
        return {"p50_ms": float("nan"), "p99_ms": float("nan"), "n": 0}
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"p50_ms": 1000 * statistics.median(ordered), "p99_ms": 1000 * p99, "n": len(ordered)}


def measure(rate: float, seconds: float, redeploy: bool) -> dict[str, Any]:
    """One run: steady load for `seconds`, the change, then `seconds` more."""
    version_one("warm")
    first = patchkit.last_pipeline()
    version_two("warm")
    second = patchkit.last_pipeline()
    endpoint = patchkit.deploy(first, port=0)
    url = endpoint.url
    load = Load(url, rate)
    runner = threading.Thread(target=load.run)
    runner.start()
    time.sleep(seconds)
    called = time.monotonic()
    if redeploy:
        port = int(url.rsplit(":", 1)[1])
        endpoint.close()
        endpoint = patchkit.deploy(second, port=port)  # the same address, so the load's client finds it again
    else:
        endpoint.update(second)
    returned = time.monotonic()
    time.sleep(seconds)
    load.stop.set()
    runner.join()
    endpoint.close()
    window = (called, returned + 1.0)
    steady = [r.latency_s for r in load.records if r.sent < called and r.latency_s is not None]
    during = [r for r in load.records if window[0] <= r.sent <= window[1]]
    first_new = min((r.sent + (r.latency_s or 0) for r in load.records if r.new), default=float("nan"))
    return {
        "change": "close() and deploy()" if redeploy else "update()",
        "requests": len(load.records),
        "failed": sum(r.latency_s is None for r in load.records),
        "steady": percentiles(steady),
        "during_change": percentiles([r.latency_s for r in during if r.latency_s is not None]),
        "failed_during_change": sum(r.latency_s is None for r in during),
        "change_call_s": returned - called,
        "first_new_answer_after_call_s": first_new - called,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=50.0, help="requests per second, Poisson")
    parser.add_argument("--seconds", type=float, default=6.0, help="of steady load before and after the change")
    parser.add_argument("--change", choices=("update", "redeploy"), default=None,
                        help="measure one side here (default: each in a fresh process of its own)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--result", default=None, help="write a result file for the site (benchmarks/results/)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    if args.change is not None:
        results = [measure(args.rate, args.seconds, redeploy=args.change == "redeploy")]
    else:
        results = [_in_fresh_process(args, change) for change in ("update", "redeploy")]
    for result in results:
        print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"rate": args.rate, "seconds": args.seconds, "results": results}, out, indent=2)
    if args.result:
        provenance.write(args.result, result_file(args.rate, args.seconds, results, load_before))


def result_file(rate: float, seconds: float, results: list[dict[str, Any]], load_before: float) -> dict[str, Any]:
    """The run as a result file: a table of both sides and a plot of their latencies, steady and during."""
    def ms(value: float) -> str:
        return f"{value:.1f}"

    rows = [[side["change"], str(side["requests"]), str(side["failed"]),
             f"{ms(side['steady']['p50_ms'])} / {ms(side['steady']['p99_ms'])} ms",
             f"{ms(side['during_change']['p50_ms'])} / {ms(side['during_change']['p99_ms'])} ms",
             f"{side['change_call_s']:.2f} s", f"{side['first_new_answer_after_call_s']:.2f} s"] for side in results]
    labels = ["steady p50", "steady p99", "during p50", "during p99"]
    return provenance.result_file(
        title="Updating a served pipeline: latency during the update, against closing and deploying again",
        components="simulated", load_before=load_before,
        setup=f"A two-stage pipeline (a 2 ms batched stage the update keeps, a 5 ms batched stage it replaces) on the "
              f"local backend, an open-loop Poisson load of {rate:g} requests/s for {seconds:g} s, the change, then "
              f"{seconds:g} s more; each side in a fresh process. 'During' is every request sent from the call until "
              "1 s after it returned; the redeploy's latencies are of the requests it answered.",
        tables=[{"caption": "Requests, failures and latency (p50 / p99) of each side.",
                 "columns": ["change", "requests", "failed", "steady p50 / p99", "during the change p50 / p99",
                             "the call took", "first answer of the new version after the call"],
                 "rows": rows}],
        plots=[{"title": "Latency, steady and during the change", "kind": "bar", "ylabel": "ms", "x": labels,
                "series": {side["change"]: [round(side[part][key], 1) for part in ("steady", "during_change")
                                            for key in ("p50_ms", "p99_ms")] for side in results}}],
        rate=rate, seconds=seconds, results=results)


def _in_fresh_process(args: argparse.Namespace, change: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/{change}.json"
        command = [sys.executable, __file__, "--rate", str(args.rate), "--seconds", str(args.seconds), "--change", change,
                   "--json", out]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with open(out) as results:
            result: dict[str, Any] = json.load(results)["results"][0]
        return result


if __name__ == "__main__":
    main()
