"""The real CRAG and IRCoT examples served with the LLM's engine on every core, against the same steps
as plain sequential code on the same cores, in one run.

    python benchmarks/real_engine.py [--workloads crag-real,ircot-real] [--seconds 90] [--clients 8]

`benchmarks/throughput.py` serves the real workloads under the plan `patchkit.plan()` makes, which
pins every replica to cores of its own (no core runs more threads than it has). On 2 cores that
gives the LLM one core, while the sequential server's two whole-pipeline workers each run the LLM
on whichever core is free. This script measures the arrangement an engine wants instead: one LLM
replica computing on both cores (2 threads), the light components (retriever, grader, rewriter,
search) as floating 1-thread replicas beside it, and the sequential server of `throughput.py` on
the same 2 cores. Arms, one at a time on the same engine replica:

- `patchkit`: shared engine (CRAG's grader and rewriter call the one LLM deployment), continuous
  batching (16 sequences), prefix reuse;
- `patchkit, no prefix reuse`: the same with `LlamaCppGenerator(prefix_cache=False)`;
- `sequential`: the pre-fork server of `benchmarks/baselines/server.py`, 2 workers.

Each arm runs a closed loop of `--clients` clients for `--seconds` (`patchkit.bench.run_closed`);
throughput is answers per second over the last two thirds of the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)

import patchkit  # noqa: E402
from benchmarks.baselines.server import running  # noqa: E402
from benchmarks.baselines.workloads import WORKLOADS, Workload  # noqa: E402
from benchmarks.throughput import steady_throughput  # noqa: E402
from patchkit.bench import run_closed  # noqa: E402
from patchkit.component import make_methods  # noqa: E402
from patchkit.components import LlamaCppGenerator  # noqa: E402
from patchkit.orchestrator.resources import available_cpus  # noqa: E402
from patchkit.scheduler.offline.plan import ComponentPlan, Plan  # noqa: E402
from patchkit.tables import text_table  # noqa: E402


def engine_plan(pipeline: patchkit.Pipeline) -> Plan:
    """The LLM on every core with as many threads; the other components one thread each, beside it."""
    cores = len(available_cpus())
    components = {}
    for name, component in pipeline.components.items():
        if isinstance(component, LlamaCppGenerator):
            components[name] = ComponentPlan("cpu", 1, 1, threads=cores)
        else:
            batch = max(component.batch_limit(m) for m in make_methods(type(component)))
            components[name] = ComponentPlan("cpu", 1, batch, units=1)
    return Plan(components, 0.0, next(iter(components)), capacity={"cpu": cores})


def measure(url: str, workload: Workload, clients: int, seconds: float) -> dict[str, Any]:
    result = run_closed(url, concurrency=clients, seconds=seconds, inputs=workload.inputs, timeout_s=10 * seconds)
    summary = result.summary()
    return {"throughput": steady_throughput(result.requests, seconds), "p50_ms": summary["latency_ms"]["p50"],
            "errors": summary["errors"]}


def llm_counters(endpoint: patchkit.Endpoint) -> dict[str, float]:
    reports = endpoint.stats()["replica_reports"].values()
    keys = ("prompt_tokens_evaluated", "prompt_tokens_reused", "decode_steps", "decoded_sequences")
    found = dict.fromkeys(keys, 0.0)
    for report in reports:
        own = report.get("component_stats") or {}
        for key in keys:
            found[key] += float(own.get(key, 0))
    return found


def patchkit_arm(workload: Workload, prefix_cache: bool, clients: int, seconds: float) -> dict[str, Any]:
    pipeline = workload.capture(workload.build())
    for component in pipeline.components.values():
        if isinstance(component, LlamaCppGenerator):  # its replicas are built from its spec: rebuild it with the setting
            spec = component._patchkit_spec
            component.__dict__["_patchkit_spec"] = dataclasses.replace(spec, kwargs={**spec.kwargs, "prefix_cache": prefix_cache})
    with patchkit.deploy(pipeline, plan=engine_plan(pipeline), autoscale=False, request_timeout_s=900) as endpoint:
        found = measure(endpoint.url, workload, clients, seconds)
        counters = llm_counters(endpoint)
    found["sequences_per_step"] = counters["decoded_sequences"] / max(1.0, counters["decode_steps"])
    prompt = counters["prompt_tokens_evaluated"] + counters["prompt_tokens_reused"]
    found["prompt_reused"] = counters["prompt_tokens_reused"] / prompt if prompt else 0.0
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="crag-real,ircot-real")
    parser.add_argument("--seconds", type=float, default=90.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--out", default="real-engine.json")
    args = parser.parse_args()
    results: dict[str, Any] = {}
    rows = []
    for name in args.workloads.split(","):
        workload = WORKLOADS[name]
        arms = {
            "patchkit": patchkit_arm(workload, True, args.clients, args.seconds),
            "patchkit, no prefix reuse": patchkit_arm(workload, False, args.clients, args.seconds),
        }
        with running("sequential", workload.name, {"cpu": len(available_cpus())}, ROOT) as url:
            arms["sequential"] = measure(url, workload, args.clients, args.seconds)
        results[name] = arms
        base = arms["sequential"]["throughput"] or float("nan")
        for arm, found in arms.items():
            rows.append((name, arm, f"{found['throughput']:.3f}", f"{found['throughput'] / base:.2f}x",
                         f"{found['p50_ms'] or 0:.0f}", f"{found.get('sequences_per_step', 0):.2f}",
                         f"{100 * found.get('prompt_reused', 0):.0f}%", str(found["errors"])))
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(text_table(("workload", "arm", "req/s", "vs sequential", "p50 ms", "sequences/step", "prompt reused", "errors"),
                     rows))


if __name__ == "__main__":
    main()
