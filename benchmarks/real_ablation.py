"""The real CRAG and IRCoT examples served under patchkit's plan, with its optimisations switched off one
at a time, against the same steps as plain sequential code on the same cores, in one run.

    python benchmarks/real_ablation.py [--workloads crag-real,ircot-real] [--seconds 60] [--clients 8] [--skip ARM,...]

The plan is `patchkit.plan()`'s for the workload's pool (2 cores), made once per workload (profiles
are cached). Arms, each a fresh deployment driven by a closed loop of `--clients` clients for
`--seconds` (`patchkit.bench.run_closed`; throughput over the run's last two thirds):

- `patchkit`: the plan: one LLM deployment that CRAG's grader and rewriter share, prefix reuse,
  continuous batching (16 sequences), the LLM's threads as the plan gives them;
- `- shared engine` (CRAG): the grader and the rewriter each run a private copy of the LLM in place
  (`Grader()`, `Rewriter()`), planned again for that pipeline (profiling those copies at 1 and 2
  threads and 1-16 calls at once takes a while on 2 cores);
- `- prefix reuse`: the plan, with `LlamaCppGenerator(prefix_cache=False)`;
- `- thread allocation`: no plan: one replica per component (`replicas=1`), the cores shared evenly
  (`deploy()`'s default before it gave an LLM engine a replica per core);
- `- continuous batching`: the plan, the LLM's calls at once per replica set to 1;
- `sequential`: the pre-fork server of `benchmarks/baselines/server.py`, a worker per core, each
  running a request start to end with its own copy of every component.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Iterator
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
from patchkit.components import LlamaCppGenerator  # noqa: E402
from patchkit.scheduler.offline.plan import Plan  # noqa: E402
from patchkit.tables import text_table  # noqa: E402


def private_llm_crag() -> patchkit.Pipeline:
    """examples/crag.py's pipeline, its grader and rewriter each with a private copy of the LLM."""
    from examples import crag
    from patchkit.components import Grader, Rewriter, sources

    retriever, llm, web, grader, rewriter = crag.retriever, crag.llm, crag.web, Grader(), Rewriter()
    question = crag.QUESTIONS[0]
    with patchkit.capture(run=False, output="result") as pipeline:
        docs = retriever.retrieve(question)
        relevant = grader.grade(question, docs)
        if not relevant:
            docs = web.search(rewriter.rewrite(question))
        answer = llm.generate(question, docs)
        result = {"answer": answer, "sources": sources(docs), "graded_relevant": relevant}  # noqa: F841
    return pipeline


def plan_of(workload: Workload, pipeline: patchkit.Pipeline) -> Plan:
    plan = patchkit.plan(pipeline, resources=workload.pool, calibration=workload.inputs[:4], progress=False)
    print(plan, file=sys.stderr)
    return plan


@contextlib.contextmanager
def without_prefix_reuse(pipeline: patchkit.Pipeline) -> Iterator[None]:
    """The pipeline's LLMs built with prefix_cache=False while inside (replicas are built from the spec)."""
    llms = [c for c in pipeline.components.values() if isinstance(c, LlamaCppGenerator)]
    specs = [llm._patchkit_spec for llm in llms]
    for llm, spec in zip(llms, specs):
        llm.__dict__["_patchkit_spec"] = dataclasses.replace(spec, kwargs={**spec.kwargs, "prefix_cache": False})
    try:
        yield
    finally:
        for llm, spec in zip(llms, specs):
            llm.__dict__["_patchkit_spec"] = spec


def one_call_at_once(pipeline: patchkit.Pipeline, plan: Plan) -> Plan:
    """The plan with every LLM replica running one call at a time (its batch size: calls at once)."""
    llms = {n for n, c in pipeline.components.items() if isinstance(c, LlamaCppGenerator)}
    components = {n: dataclasses.replace(c, batch_size=1) if n in llms else c for n, c in plan.components.items()}
    return dataclasses.replace(plan, components=components)


def measure(url: str, workload: Workload, clients: int, seconds: float) -> dict[str, Any]:
    result = run_closed(url, concurrency=clients, seconds=seconds, inputs=workload.inputs, timeout_s=10 * seconds)
    summary = result.summary()
    return {"throughput": steady_throughput(result.requests, seconds), "p50_ms": summary["latency_ms"]["p50"],
            "errors": summary["errors"]}


def llm_counters(endpoint: patchkit.Endpoint) -> dict[str, float]:
    keys = ("prompt_tokens_evaluated", "prompt_tokens_reused", "decode_steps", "decoded_sequences")
    found = dict.fromkeys(keys, 0.0)
    for report in endpoint.stats()["replica_reports"].values():
        own = report.get("component_stats") or {}
        for key in keys:
            found[key] += float(own.get(key, 0))
    return found


def patchkit_arm(workload: Workload, pipeline: patchkit.Pipeline, options: dict[str, Any], clients: int,
                 seconds: float) -> dict[str, Any]:
    reuse = options.pop("prefix_reuse", True)
    with (contextlib.nullcontext() if reuse else without_prefix_reuse(pipeline),
          patchkit.deploy(pipeline, autoscale=False, request_timeout_s=900, **options) as endpoint):
        found = measure(endpoint.url, workload, clients, seconds)
        counters = llm_counters(endpoint)
    found["sequences_per_step"] = counters["decoded_sequences"] / max(1.0, counters["decode_steps"])
    prompt = counters["prompt_tokens_evaluated"] + counters["prompt_tokens_reused"]
    found["prompt_reused"] = counters["prompt_tokens_reused"] / prompt if prompt else 0.0
    return found


def arms(workload: Workload) -> dict[str, Callable[[], tuple[patchkit.Pipeline, dict[str, Any]]]]:
    """Each arm: the pipeline it serves and deploy()'s options for it, built when the arm runs."""

    def fresh() -> patchkit.Pipeline:
        return workload.capture(workload.build())

    planned = plan_of(workload, fresh())

    def no_batching() -> tuple[patchkit.Pipeline, dict[str, Any]]:
        pipeline = fresh()
        return pipeline, {"plan": one_call_at_once(pipeline, planned)}

    def private_engines() -> tuple[patchkit.Pipeline, dict[str, Any]]:
        pipeline = private_llm_crag()
        return pipeline, {"plan": plan_of(workload, pipeline)}

    found: dict[str, Callable[[], tuple[patchkit.Pipeline, dict[str, Any]]]] = {"patchkit": lambda: (fresh(), {"plan": planned})}
    if workload.name == "crag-real":
        found["- shared engine"] = private_engines
    found["- prefix reuse"] = lambda: (fresh(), {"plan": planned, "prefix_reuse": False})
    found["- thread allocation"] = lambda: (fresh(), {"replicas": 1})
    found["- continuous batching"] = no_batching
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="crag-real,ircot-real")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--out", default="real-ablation.json")
    parser.add_argument("--skip", default="", help="arms to leave out, comma-separated (such as '- shared engine')")
    args = parser.parse_args()
    skipped = {arm.strip() for arm in args.skip.split(",") if arm.strip()}
    results: dict[str, Any] = {}
    rows = []
    for name in args.workloads.split(","):
        workload = WORKLOADS[name]
        found: dict[str, Any] = {}
        for arm, build in arms(workload).items():
            if arm in skipped:
                continue
            pipeline, options = build()
            found[arm] = patchkit_arm(workload, pipeline, options, args.clients, args.seconds)
            print(f"{name} {arm}: {found[arm]['throughput']:.3f} req/s", file=sys.stderr)
        with running("sequential", workload.name, workload.pool, ROOT) as url:
            found["sequential"] = measure(url, workload, args.clients, args.seconds)
        results[name] = found
        base = found["sequential"]["throughput"] or float("nan")
        for arm, got in found.items():
            rows.append((name, arm, f"{got['throughput']:.3f}", f"{got['throughput'] / base:.2f}x",
                         f"{got['p50_ms'] or 0:.0f}", f"{got.get('sequences_per_step', 0):.2f}",
                         f"{100 * got.get('prompt_reused', 0):.0f}%", str(got["errors"])))
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(text_table(("workload", "arm", "req/s", "vs sequential", "p50 ms", "sequences/step", "prompt reused", "errors"),
                     rows))


if __name__ == "__main__":
    main()
