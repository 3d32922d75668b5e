"""`patchkit bench URL`: load generators and reports for any patchkit endpoint.

    patchkit bench URL (--rate 50 | --schedule "0:50,10:100,20:50" | --concurrency 64) --seconds 30
                       (--inputs '{"query": "..."}' | --inputs-file FILE.jsonl) [--slo-ms N] [--json out.json] [--plot out.png]

`run_bench` sends an open loop of Poisson arrivals (seeded, so a run's arrival times repeat), at one
rate or at a schedule of `seconds:rate` steps: a slow endpoint shows as growing latency and errors,
not as a lower offered rate. `run_closed` runs a closed loop of concurrent clients instead, to find
the most an endpoint can answer. Both read `GET /v1/stats` once a second for each component's
replicas, and return a `BenchResult`: one `RequestRecord` per request and, from them, the summary
(throughput, p50/p90/p99 latency, SLO attainment, errors by status), a per-second series, a text
table, JSON, and a Patchwork Figure 15 style plot (`pip install -e '.[bench]'` for matplotlib).

The modules, one concern each: `schedule` (arrival times), `load` (the generators), `report`
(records and `BenchResult`), `plot` (the PNG), `cli` (the command line).
"""

from __future__ import annotations

from patchkit.bench.cli import add_arguments, main, run_from_args
from patchkit.bench.load import run_bench, run_closed
from patchkit.bench.report import BenchResult, ReplicaSample, RequestRecord
from patchkit.bench.schedule import Schedule

__all__ = [
    "BenchResult",
    "ReplicaSample",
    "RequestRecord",
    "Schedule",
    "add_arguments",
    "main",
    "run_bench",
    "run_closed",
    "run_from_args",
]
