"""Time to first token against time to the whole answer, on the CRAG example, streaming and not, in one run.

    python benchmarks/ttft.py [--seconds 60] [--clients 4] [--result benchmarks/results/streaming.json]
    python benchmarks/ttft.py --breakdown 4 [--json ttft-breakdown.json]

Deploys `examples/crag.py` (one LLM deployment serving the grader, the rewriter and the answer) and
drives it twice with the same closed loop of `--clients` clients over its questions: once asking
for the answer whole (`POST /v1/query`), once streamed (`"stream": true`: server-sent events, the
answer's tokens as the engine makes them). Reports per run the answers per second and the p50 / p99
of the latency to the whole answer and, streamed, of the time to the first token.

`--breakdown N` splits the time to the first token instead, one streamed question at a time, on
capacity.py's job (`benchmarks/rag_stream.py`'s retrieve-then-answer pipeline, deployed with no plan:
the machine's layout) and N new questions of its stream: the retrieval call and the queue waits (step
events, and the request's trace: its SLO is set far off so that it keeps one), the engine's prompt
evaluation and document-cache reads (its counters, before and after each question), and what is left:
the HTTP front-end, the router, the gRPC hops, tokenizing and the first token's sampling.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402 - benchmarks/provenance.py: this script's directory is on sys.path

import patchkit  # noqa: E402
from patchkit.bench import run_closed  # noqa: E402
from patchkit.tables import text_table  # noqa: E402


def breakdown(count: int) -> dict[str, Any]:
    """The time to first token of `count` new questions, one at a time, split by where it went (see the module)."""
    from benchmarks.question_stream import catalogue, draw
    from benchmarks.rag_stream import rag_pipeline
    from patchkit.client.streams import Step
    from patchkit.components import FaissRetriever, LlamaCppGenerator
    from patchkit.components.documents import pydoc_corpus

    modules = {doc.title for doc in pydoc_corpus() if doc.id.startswith("module:")}
    questions = [q.text for q in draw(catalogue(modules, seed=1), count, seed=1)]
    pipeline = rag_pipeline(FaissRetriever("pydoc", topk=3), LlamaCppGenerator(max_tokens=64))
    found: dict[str, Any] = {"load_before": os.getloadavg()[0], "questions": []}
    with patchkit.deploy(pipeline, slo_ms=3_600_000) as endpoint:
        endpoint.query(question="What is the Python standard library?")  # warm: models loaded, first calls made
        found["plan"] = endpoint.plan().get("plan")
        for question in questions:
            before = engine_counters(endpoint)
            began, first, steps = time.perf_counter(), None, []
            for item in endpoint.stream(steps=True, question=question):
                if isinstance(item, Step):
                    steps.append(item)
                elif first is None and item:
                    first = time.perf_counter() - began
            spent = {k: v - before.get(k, 0.0) for k, v in engine_counters(endpoint).items()}
            trace = endpoint.traces()[-1]
            retrieval = sum(s.duration_ms or 0.0 for s in steps if s.phase == "end" and s.component != "llm") / 1000
            parts = {"ttft_s": first, "retrieval_s": retrieval, "queue_wait_s": sum(v.waited for v in trace.visits),
                     "prefill_s": spent.get("prefill_s", 0.0), "document_cache_s": spent.get("kv_cache_s", 0.0),
                     "prompt_tokens": spent.get("prompt_tokens_evaluated", 0.0),
                     "reused_tokens": spent.get("prompt_tokens_reused", 0.0)}
            parts["rest_s"] = (first or 0.0) - sum(parts[k] for k in ("retrieval_s", "queue_wait_s", "prefill_s",
                                                                      "document_cache_s"))
            found["questions"].append({"question": question, **parts})
    found["load_after"] = os.getloadavg()[0]
    rows = [(q["question"][:40], f"{q['ttft_s']:.2f}", f"{1000 * q['retrieval_s']:.0f}", f"{1000 * q['queue_wait_s']:.2f}",
             f"{q['prefill_s']:.2f} ({q['prompt_tokens']:.0f} tok)", f"{1000 * q['document_cache_s']:.0f}",
             f"{1000 * q['rest_s']:.0f}") for q in found["questions"]]
    print(text_table(("question", "TTFT s", "retrieval ms", "queue waits ms", "prompt evaluation s", "document cache ms",
                      "rest ms"), rows))
    print(f"load {found['load_before']:.1f}-{found['load_after']:.1f}")
    return found


def engine_counters(endpoint: patchkit.Endpoint) -> dict[str, float]:
    """The LLM replicas' counters, summed."""
    summed: dict[str, float] = {}
    for report in endpoint.stats()["replica_reports"].values():
        own = report.get("component_stats") or {}
        if "prefill_s" in own:
            for key, value in own.items():
                if isinstance(value, (int, float)):
                    summed[key] = summed.get(key, 0.0) + float(value)
    return summed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--result", default=None, help="write a result file for the site (benchmarks/results/)")
    parser.add_argument("--breakdown", type=int, default=0, help="split the TTFT of this many questions, one at a time")
    parser.add_argument("--json", default="ttft-breakdown.json", help="with --breakdown: the raw results")
    args = parser.parse_args()
    if args.breakdown:
        Path(args.json).write_text(json.dumps(breakdown(args.breakdown), indent=1, default=str) + "\n")
        return
    load_before = os.getloadavg()[0]
    from examples import crag

    inputs = [{"question": q} for q in crag.QUESTIONS]
    rows = []
    with patchkit.deploy(crag.pipeline, request_timeout_s=600) as endpoint:
        run_closed(endpoint.url, concurrency=args.clients, seconds=10, inputs=inputs, timeout_s=600)  # warm the caches
        for stream in (False, True):
            summary = run_closed(endpoint.url, concurrency=args.clients, seconds=args.seconds, inputs=inputs,
                                 timeout_s=600, stream=stream).summary()
            latency, first = summary["latency_ms"], summary["ttft_ms"] or {}
            rows.append((
                "streamed" if stream else "whole", str(summary["ok"]), f"{summary['ok'] / summary['elapsed_s']:.2f}",
                f"{latency['p50']:.0f}", f"{latency['p99']:.0f}",
                f"{first['p50']:.0f}" if first.get("p50") is not None else "-",
                f"{first['p99']:.0f}" if first.get("p99") is not None else "-",
            ))
    header = ("answers", "ok", "answers/s", "whole answer p50 ms", "p99 ms", "first token p50 ms", "p99 ms")
    print(text_table(header, rows))
    if args.result:
        provenance.write(args.result, provenance.result_file(
            title="Streaming: time to first token against the whole answer (CRAG)", components="real models",
            load_before=load_before,
            setup=f"examples/crag.py deployed (SmolLM2-135M in llama.cpp: one LLM deployment grades, rewrites and "
                  f"answers), a closed loop of {args.clients} clients over its {len(inputs)} questions for "
                  f"{args.seconds:g} s asking for whole answers, then {args.seconds:g} s streamed, after a 10 s "
                  "warm-up; the questions repeat, so the engine's prefix cache is warm.",
            tables=[{"caption": "Answers in each run; latency to the whole answer and, streamed, to the first token.",
                     "columns": list(header), "rows": [list(row) for row in rows]}],
            plots=[{"title": "Median latency (ms)", "kind": "bar", "ylabel": "ms",
                    "x": ["whole answer", "first token"],
                    "series": {row[0]: [float(row[3]), float(row[5]) if row[5] != "-" else 0.0] for row in rows}}]))


if __name__ == "__main__":
    main()
