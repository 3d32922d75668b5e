"""Time to first token against time to the whole answer, on the CRAG example, streaming and not, in one run.

    python benchmarks/ttft.py [--seconds 60] [--clients 4] [--result benchmarks/results/streaming.json]

Deploys `examples/crag.py` (one LLM deployment serving the grader, the rewriter and the answer) and
drives it twice with the same closed loop of `--clients` clients over its questions: once asking
for the answer whole (`POST /v1/query`), once streamed (`"stream": true`: server-sent events, the
answer's tokens as the engine makes them). Reports per run the answers per second and the p50 / p99
of the latency to the whole answer and, streamed, of the time to the first token.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402 - benchmarks/provenance.py: this script's directory is on sys.path

import patchkit  # noqa: E402
from patchkit.bench import run_closed  # noqa: E402
from patchkit.tables import text_table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--result", default=None, help="write a result file for the site (benchmarks/results/)")
    args = parser.parse_args()
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
