"""benchmarks/parallel_calls.py runs as its README section says, with tiny delays: every pipeline it measures
answers the same deployed with parallel calls on and off and run eagerly. Its timings are for the README,
never asserted here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BENCHMARK = ROOT / "benchmarks" / "parallel_calls.py"
PIPELINES = ["two searches, then a merge", "4 calls of one batch method in a comprehension",
             "diamond: a; b(a), c(a); d(b, c)", "chain of three dependent calls"]


def test_the_benchmark_runs_and_finds_every_output_equal_on_off_and_eager(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    command = [sys.executable, str(BENCHMARK), "--requests", "3", "--delay", "0.01", "--seconds", "1", "--json", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())

    rows = results["latency"]
    assert [row["pipeline"] for row in rows] == PIPELINES
    for row in rows:
        assert (row["requests"], row["outputs_differ"], row["outputs_not_eager"]) == (3, [], []), row
    assert [row["overlap_groups"] for row in rows] == [["left.run + right.run"], ["embedder.run"], ["left.run + right.run"], []]
    assert results["throughput"]["errors"] == {"off": 0, "on": 0}
    assert all(results["throughput"]["req_per_s"][arm] > 0 for arm in ("off", "on"))
    assert "two searches, then a merge" in done.stdout and "Throughput at saturation" in done.stdout
