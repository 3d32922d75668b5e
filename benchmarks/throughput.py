"""Throughput and latency against the systems users would pick instead, side by side in one run.

    python benchmarks/throughput.py [--quick] [--workloads crag-gpu,ircot-gpu,...] [--out DIR]

Each workload (`benchmarks/baselines/workloads.py`: CRAG- and IRCoT-shaped pipelines on Simulated
components with the papers' latency curves, then on the real CPU components) is served three ways
over the same component classes and arguments and the same resource budget (the workload's `pool`):

- patchkit: `deploy(plan=...)` with the plan `patchkit.plan()` makes for the pool (what
  `plan="auto"` does; made once per workload so every load point runs the same plan);
- sequential: a pre-fork HTTP server, one worker process per unit of the pool, each running a
  request start to end, one at a time (`benchmarks/baselines/server.py`);
- langgraph: the same pre-fork server, each worker running concurrent `ainvoke` calls of a
  StateGraph of the same steps with conditional edges.

Every system gets a fresh start at each load point and is driven by the same open-loop Poisson
generator (`patchkit.bench.run_bench`) at rates set as fractions of the plan's predicted
throughput. Throughput at saturation is the highest throughput a system reaches over the sweep.
The real workloads, whose requests take seconds, are driven instead by a closed loop of
`REAL_CLIENTS` clients (`patchkit.bench.run_closed`), which keeps every system saturated.

The ablation (Patchwork Figure 12(b)) deploys patchkit with its optimisations switched on one at
a time at a saturating rate: none (batch size 1, no pipelining, the pool split evenly), then
component-level batching, then pipelining, then the planned allocation.

Writes DIR/throughput.json, DIR/throughput.png (Figure 11 style) and DIR/ablation.png, and prints
the tables `benchmarks/README.md` records.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# Worker processes (patchkit's and the baseline servers') import the workloads' module too.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

import patchkit  # noqa: E402
from benchmarks.baselines.server import running  # noqa: E402
from benchmarks.baselines.workloads import WORKLOADS, Workload  # noqa: E402
from patchkit.bench import RequestRecord, run_bench, run_closed  # noqa: E402
from patchkit.core import make_methods  # noqa: E402
from patchkit.tables import text_table  # noqa: E402

logger = logging.getLogger("throughput")

SYSTEMS = ("patchkit", "langgraph", "sequential")
SIM = ("crag-gpu", "crag-cpu", "ircot-gpu", "ircot-cpu")
REAL = ("crag-real", "ircot-real")
REAL_CLIENTS = 8  # the real workloads run a closed loop of this many clients (see measure_closed)
FULL = {"loads": (0.1, 0.4, 0.8, 1.3), "seconds": 5.0, "real_loads": (), "real_seconds": 90.0,
        "ablation": ("crag-gpu", "crag-cpu", "ircot-gpu"), "workloads": SIM + REAL}
QUICK = {"loads": (0.1, 0.5, 1.2), "seconds": 3.0, "real_loads": (), "real_seconds": 30.0,
         "ablation": ("ircot-gpu",), "workloads": SIM}
STEADY_FROM = 1 / 3  # of the run: throughput counts the answers after it
ABLATION_LOAD = 1.3  # of the plan's prediction: past every arm's saturation


# --- serving each system ------------------------------------------------------------------------------
@contextlib.contextmanager
def serve(system: str, workload: Workload, pipeline: patchkit.Pipeline, plan: patchkit.Plan, **options: Any) -> Iterator[str]:
    """An endpoint URL for `system` serving `workload`: patchkit under `plan` (or `options`), else a baseline server."""
    if system != "patchkit":
        with running(system, workload.name, workload.pool, ROOT) as url:
            yield url
        return
    settings: dict[str, Any] = {"autoscale": False, **options}  # a fixed budget: no replica beyond the plan's
    if "replicas" not in settings:
        settings["plan"] = plan
    with patchkit.deploy(pipeline, **settings) as endpoint:
        yield endpoint.url


def measure_closed(url: str, workload: Workload, clients: int, seconds: float) -> dict[str, Any]:
    """One closed-loop run of `clients` clients, each asking again as soon as it is answered: every system
    at saturation. For the real workloads, whose requests take seconds, an open loop at a fixed rate
    mostly measures the rate."""
    result = run_closed(url, concurrency=clients, seconds=seconds, inputs=workload.inputs, timeout_s=10 * seconds)
    s = result.summary()
    return {"rate": float(clients), "throughput": steady_throughput(result.requests, seconds), "p50_ms": s["latency_ms"]["p50"],
            "p99_ms": s["latency_ms"]["p99"], "ok": s["ok"], "errors": s["errors"]}


def measure(url: str, workload: Workload, rate: float, seconds: float) -> dict[str, Any]:
    """One open-loop Poisson run. A request unanswered after `seconds` (at least 5 s) counts as an error: it
    could not have counted towards the run's throughput anyway, and waiting longer only lengthens the run."""
    result = run_bench(url, rate=rate, seconds=seconds, inputs=workload.inputs, timeout_s=max(5.0, seconds))
    s = result.summary()
    return {"rate": rate, "throughput": steady_throughput(result.requests, seconds), "p50_ms": s["latency_ms"]["p50"],
            "p99_ms": s["latency_ms"]["p99"], "ok": s["ok"], "errors": s["errors"]}


def steady_throughput(requests: Sequence[RequestRecord], seconds: float) -> float:
    """Answers per second over the run's last two thirds: the first third fills the pipeline (a request
    takes up to a second here, several under overload), which counting from zero would charge as lost
    throughput, more to the slower system."""
    start = seconds * STEADY_FROM
    done = (r.sent_s + r.latency_ms / 1000 for r in requests if r.ok)
    return sum(start <= t < seconds for t in done) / (seconds - start)


# --- the sweep ----------------------------------------------------------------------------------------
def plan_for(workload: Workload, pipeline: patchkit.Pipeline) -> patchkit.Plan:
    calibration = workload.inputs[:4] if workload.real else workload.inputs[:16]
    plan = patchkit.plan(pipeline, resources=workload.pool, calibration=calibration, progress=False)
    print(plan, file=sys.stderr)
    return plan


def sweep(workload: Workload, pipeline: patchkit.Pipeline, plan: patchkit.Plan, loads: Sequence[float],
          seconds: float) -> dict[str, Any]:
    rates = [float(REAL_CLIENTS)] if workload.real else [round(load * plan.throughput, 2) for load in loads]
    found: dict[str, Any] = {"plan": plan.to_dict(), "predicted": plan.throughput, "rates": rates, "systems": {}}
    for system in SYSTEMS:
        points = []
        for rate in rates:
            with serve(system, workload, pipeline, plan) as url:
                if workload.real:
                    points.append(measure_closed(url, workload, REAL_CLIENTS, seconds))
                else:
                    points.append(measure(url, workload, rate, seconds))
            print(f"{workload.name:10} {system:10} {rate:8.1f} req/s offered: {points[-1]['throughput']:8.1f} req/s, "
                  f"p50 {_ms(points[-1]['p50_ms'])}, p99 {_ms(points[-1]['p99_ms'])} ms", file=sys.stderr)
        found["systems"][system] = {"points": points, "saturation": max(p["throughput"] for p in points)}
    sat = {system: found["systems"][system]["saturation"] for system in SYSTEMS}
    found["ratios"] = {f"patchkit/{s}": sat["patchkit"] / sat[s] if sat[s] else None for s in SYSTEMS[1:]}
    return found


def uniform_replicas(pipeline: patchkit.Pipeline, pool: dict[str, int]) -> dict[str, int]:
    """The pool split evenly: each resource type's units dealt round the components on it, in pipeline order."""
    replicas = dict.fromkeys(pipeline.components, 0)
    for kind, units in pool.items():
        names = [n for n, c in pipeline.components.items() if c.devices[0] == kind]
        for i in range(units if names else 0):
            replicas[names[i % len(names)]] += 1
    return replicas


def ablation(workload: Workload, pipeline: patchkit.Pipeline, plan: patchkit.Plan, seconds: float) -> dict[str, Any]:
    rate = round(ABLATION_LOAD * plan.throughput, 2)
    ones = {f"{n}.{m}": 1 for n, c in pipeline.components.items() for m in make_methods(type(c))}
    arms = {  # without the plan: deploy()'s default of one replica per component
        "none": {"replicas": 1, "batch_size": ones, "pipelining": False},
        "+batching": {"replicas": 1, "pipelining": False},
        "+pipelining": {"replicas": 1},
        "+planned allocation": {},
        "even split, no plan": {"replicas": uniform_replicas(pipeline, workload.pool)},
    }
    found: dict[str, Any] = {"rate": rate, "arms": {}}
    for arm, options in arms.items():
        with serve("patchkit", workload, pipeline, plan, **options) as url:
            found["arms"][arm] = measure(url, workload, rate, seconds)
        print(f"{workload.name:10} ablation {arm:20} {found['arms'][arm]['throughput']:8.1f} req/s", file=sys.stderr)
    return found


# --- reporting ----------------------------------------------------------------------------------------
def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def tables(results: dict[str, Any]) -> str:
    parts = []
    rows = []
    for name, w in results["workloads"].items():
        sat = {s: w["systems"][s]["saturation"] for s in SYSTEMS}
        rows.append((name, f"{w['predicted']:.0f}", *(f"{sat[s]:.1f}" for s in SYSTEMS),
                     *(f"{r:.2f}x" if r else "-" for r in w["ratios"].values())))
    parts.append(text_table(["workload", "plan predicts", *(f"{s} req/s" for s in SYSTEMS), "vs langgraph", "vs sequential"],
                            rows))
    for name, w in results["workloads"].items():
        point_rows = []
        for i, rate in enumerate(w["rates"]):
            cells = [f"{rate:.1f}"]
            for s in SYSTEMS:
                p = w["systems"][s]["points"][i]
                cells.append(f"{p['throughput']:.1f} / {_ms(p['p50_ms'])} / {_ms(p['p99_ms'])}")
            point_rows.append(tuple(cells))
        parts.append(f"{name}: throughput req/s / p50 ms / p99 ms per offered rate\n"
                     + text_table(["offered req/s", *SYSTEMS], point_rows))
    for name, a in results.get("ablation", {}).items():
        base = a["arms"]["none"]["throughput"] or float("nan")
        arm_rows = [(arm, f"{p['throughput']:.1f}", f"{p['throughput'] / base:.2f}x") for arm, p in a["arms"].items()]
        parts.append(f"{name} ablation at {a['rate']:.0f} req/s offered\n" + text_table(["arm", "req/s", "vs none"], arm_rows))
    return "\n\n".join(parts)


def plot(results: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["workloads"])
    figure, axes = plt.subplots(2, len(names), figsize=(4 * len(names), 7), squeeze=False, constrained_layout=True)
    for column, name in enumerate(names):
        w = results["workloads"][name]
        for system in SYSTEMS:
            points = w["systems"][system]["points"]
            axes[0][column].plot(w["rates"], [p["throughput"] for p in points], marker="o", label=system)
            axes[1][column].plot(w["rates"], [p["p99_ms"] or float("nan") for p in points], marker="o", label=system)
        axes[0][column].set_title(name)
        axes[0][column].set_ylabel("throughput (req/s)")
        axes[1][column].set_ylabel("p99 latency (ms)")
        axes[1][column].set_yscale("log")
        axes[1][column].set_xlabel("offered load (req/s)")
    axes[0][0].legend()
    figure.savefig(out / "throughput.png", dpi=110)
    plt.close(figure)
    if results.get("ablation"):
        figure, axes = plt.subplots(1, len(results["ablation"]), figsize=(5 * len(results["ablation"]), 4), squeeze=False,
                                    constrained_layout=True)
        for ax, (name, a) in zip(axes[0], results["ablation"].items()):
            sequential = results["workloads"][name]["systems"]["sequential"]["saturation"]
            labels = ["sequential", *a["arms"]]
            values = [sequential, *(p["throughput"] for p in a["arms"].values())]
            ax.bar(labels, values, color=["tab:red"] + ["tab:blue"] * len(a["arms"]))
            ax.set_title(f"{name}: optimisations on one at a time")
            ax.set_ylabel("throughput (req/s)")
            ax.tick_params(axis="x", rotation=20)
        figure.savefig(out / "ablation.png", dpi=110)
        plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer load points, shorter, simulated workloads only")
    parser.add_argument("--workloads", help=f"comma-separated, from {', '.join(WORKLOADS)}")
    parser.add_argument("--out", default="throughput-results", help="directory for the JSON and the plots")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    settings = QUICK if args.quick else FULL
    names = args.workloads.split(",") if args.workloads else list(settings["workloads"])
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        raise SystemExit(f"--workloads: unknown {', '.join(unknown)}; known: {', '.join(WORKLOADS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict[str, Any] = {"settings": {k: v for k, v in settings.items()}, "workloads": {}, "ablation": {}}
    for name in names:
        workload = WORKLOADS[name]
        pipeline = workload.capture(workload.build())
        plan = plan_for(workload, pipeline)
        loads, seconds = (settings["real_loads"], settings["real_seconds"]) if workload.real else (settings["loads"],
                                                                                                   settings["seconds"])
        results["workloads"][name] = sweep(workload, pipeline, plan, loads, seconds)
        if name in settings["ablation"]:
            results["ablation"][name] = ablation(workload, pipeline, plan, seconds)
        (out / "throughput.json").write_text(json.dumps(results, indent=1))  # a run cut short keeps what it measured
    results["wall_s"] = time.perf_counter() - started
    (out / "throughput.json").write_text(json.dumps(results, indent=1))
    print(tables(results))
    plot(results, out)
    print(f"\nwall time {results['wall_s']:.0f} s; wrote {out}/throughput.json, throughput.png, ablation.png")


if __name__ == "__main__":
    main()
