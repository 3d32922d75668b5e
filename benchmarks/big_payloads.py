"""Large values on the way to the workers: `deploy()` of a component given 1 MB and 100 MB of distinct texts, and
`/healthz` while an update of a component reading a 100 MB module global runs.

Each measurement runs in a fresh process on the default backend (local worker processes), on new random
data. Beside each deploy time stands the machine's bound for moving that argument: pickling it and loading it
back once (`pickle.dumps` + `pickle.loads`), which any server that starts its model in another process pays
at least once per hop.

    python benchmarks/big_payloads.py --runs 3 --json big_payloads.json --result benchmarks/results/big_payloads.json

Reports, per size: deploy() until every worker is ready, and its first query; the bound; the ratio of the
100 MB deploy to the 1 MB one. For the update: how long `update()` took, and `/healthz` latency p50/p99/max
polled every 10 ms throughout it.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import numpy as np
import provenance  # benchmarks/provenance.py: this script's directory is on sys.path

import patchkit
from patchkit import Component, make

TEXT_BYTES = 1000  # each text of the argument: distinct random letters


class Corpus(Component):
    """Holds the texts it was given; answers how many contain a word."""

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts

    @make
    def count(self, word: str) -> int:
        return sum(word in text for text in self.texts)


def _texts(megabytes: float, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    count = max(1, int(megabytes * 1_000_000 / TEXT_BYTES))
    letters = rng.integers(97, 123, size=(count, TEXT_BYTES), dtype=np.uint8)
    return [row.tobytes().decode() for row in letters]


def deploy_once(megabytes: float, seed: int) -> dict[str, float]:
    """In this (fresh) process: deploy a Corpus of `megabytes` of texts; the seconds it took, and the bound."""
    texts = _texts(megabytes, seed)
    start = time.perf_counter()
    loaded = pickle.loads(pickle.dumps(texts, protocol=pickle.HIGHEST_PROTOCOL))  # noqa: S301 - our own bytes
    bound = time.perf_counter() - start
    assert loaded == texts
    corpus = Corpus(texts)
    word = "abc"
    with patchkit.capture() as pipeline:
        found = corpus.count(word)
    start = time.perf_counter()
    with patchkit.deploy(pipeline) as endpoint:
        deployed = time.perf_counter() - start
        assert endpoint.query(word="abc") == found
        answered = time.perf_counter() - start
    return {"megabytes": megabytes, "deploy_s": deployed, "first_answer_s": answered, "bound_s": bound}


BIG_GLOBAL = """\
import numpy as np

import patchkit
from patchkit import Component, make

TABLE = np.random.default_rng({seed}).integers(0, 255, size={size}, dtype=np.uint8)


class Lookup(Component):
    @make
    def look(self, index: int) -> int:
        return int(TABLE[index])


lookup = Lookup()
index = 7
with patchkit.capture() as pipeline:
    value = lookup.look(index)
"""


def update_once(megabytes: float, seed: int) -> dict[str, float]:
    """In this (fresh) process: deploy a component reading a global of `megabytes`, update it to a new one while
    `/healthz` is polled; the update's seconds and the probes' latencies."""
    import runpy
    import tempfile

    def load(folder: str, seed: int) -> patchkit.Pipeline:
        path = os.path.join(folder, f"lookup_{seed}.py")
        with open(path, "w") as file:
            file.write(BIG_GLOBAL.format(seed=seed, size=int(megabytes * 1_000_000)))
        pipeline: patchkit.Pipeline = runpy.run_path(path, run_name="lookup")["pipeline"]
        return pipeline

    with tempfile.TemporaryDirectory() as folder, patchkit.deploy(load(folder, seed)) as endpoint:
        edited = load(folder, seed + 1)
        waits: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=endpoint.url, timeout=30) as client:
                while not stop.is_set():
                    sent = time.perf_counter()
                    client.get("/healthz").raise_for_status()
                    waits.append(time.perf_counter() - sent)
                    time.sleep(0.01)

        prober = threading.Thread(target=probe)
        prober.start()
        time.sleep(0.3)
        start = time.perf_counter()
        endpoint.update(edited)
        took = time.perf_counter() - start
        time.sleep(0.3)
        stop.set()
        prober.join()
    waits.sort()
    return {"megabytes": megabytes, "update_s": took, "probes": len(waits), "healthz_p50_ms": 1000 * waits[len(waits) // 2],
            "healthz_p99_ms": 1000 * waits[int(len(waits) * 0.99)], "healthz_max_ms": 1000 * waits[-1]}


def _fresh(kind: str, megabytes: float, seed: int) -> dict[str, float]:
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import json, big_payloads; "
            f"print(json.dumps(big_payloads.{kind}_once({megabytes}, {seed})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write every run here")
    parser.add_argument("--result", help="write the result file (benchmarks/results/) here")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    deploys: dict[float, list[dict[str, float]]] = {1.0: [], 100.0: []}
    updates: list[dict[str, float]] = []
    for run in range(args.runs):  # the sides alternate, each in a fresh process, new data each time
        for megabytes, rows in deploys.items():
            rows.append(_fresh("deploy", megabytes, 100 * run + int(megabytes)))
            print(json.dumps(rows[-1]), flush=True)
        updates.append(_fresh("update", 100.0, 1000 + run))
        print(json.dumps(updates[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"deploy": {str(k): v for k, v in deploys.items()}, "update": updates}, file, indent=2)
    result = _result(deploys, updates, load_before)
    for row in result["tables"][0]["rows"]:
        print(" | ".join(row))
    if args.result:
        provenance.write(args.result, result)


def _result(deploys: dict[float, list[dict[str, float]]], updates: list[dict[str, float]], load_before: float) -> dict[str, Any]:
    def median(rows: list[dict[str, float]], key: str) -> float:
        return statistics.median(row[key] for row in rows)

    small, large = (median(deploys[size], "deploy_s") for size in (1.0, 100.0))
    rows = [[f"deploy(), {size:g} MB of distinct texts", f"{median(r, 'deploy_s'):.2f} s",
             f"{median(r, 'first_answer_s'):.2f} s", f"{median(r, 'bound_s'):.3f} s"] for size, r in deploys.items()]
    rows.append(["100 MB against 1 MB", f"**{large / small:.2f}x**", "", "target <= 3x: " + ("met" if large / small <= 3 else
                                                                                           "not met")])
    probes = [["update() of a 100 MB global", f"{median(updates, 'update_s'):.2f} s",
               f"{median(updates, 'healthz_p50_ms'):.1f} / {median(updates, 'healthz_p99_ms'):.1f} ms",
               f"{max(u['healthz_max_ms'] for u in updates):.1f} ms (target < 100 ms)"]]
    return provenance.result_file(
        title="Large values: deploy() of 1 MB and 100 MB arguments, /healthz during a 100 MB update",
        components="simulated", load_before=load_before,
        setup=("A component given a list of distinct 1,000-letter texts (1 MB and 100 MB), deployed on the default "
               "backend, each run in a fresh process on new data, the sizes alternating; then a component reading a "
               "100 MB numpy module global, updated to a new global while /healthz is polled every 10 ms. The bound: "
               "pickling the argument and loading it back once in one process."),
        tables=[{"caption": "deploy() until every worker is ready; medians of the runs", "columns":
                 ["measure", "deploy()", "first answer", "bound: pickle + unpickle once"], "rows": rows},
                {"caption": "An update with a 100 MB global: how long it took, and /healthz throughout (medians; max of all)",
                 "columns": ["measure", "update() took", "/healthz p50 / p99", "/healthz slowest"], "rows": probes}],
        plots=[{"title": "deploy() by the size of its argument, and the bound", "kind": "bar", "ylabel": "s",
                "x": [f"{size:g} MB" for size in deploys],
                "series": {"deploy()": [round(median(r, "deploy_s"), 3) for r in deploys.values()],
                           "bound: pickle + unpickle": [round(median(r, "bound_s"), 3) for r in deploys.values()]}}],
        runs={"deploy": {str(k): v for k, v in deploys.items()}, "update": updates})


if __name__ == "__main__":
    main()
