"""Where a cold plan of examples/crag.py spends its time: calibration (model loads, eager runs), then
each profile (its worker's start; for the LLM's cost model, each of its steps).

    python benchmarks/planning_phases.py --json planning-phases.json

Plans examples/crag.py with its first `--questions` questions as calibration in a fresh process with
an empty profile cache (the corpus embeddings, which are no part of planning, copied in from the
user's cache, as `planner.py --real` does), with timers around the planner's phases, and prints one
JSON object: the total, the load average before and after, and seconds per phase in the order they
ran. Each phase is timed where the planner calls it, so the times of nested phases overlap (a
worker's start is within its profile).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner import EXAMPLES, seed_vectors  # noqa: E402

# In the fresh process: wrap the phases in timers, plan, print the phases as JSON.
PHASES_SCRIPT = """
import json, sys, time
sys.path.insert(0, {examples!r})
began = time.perf_counter()
phases = []

def timed(owner, name, label):
    original = getattr(owner, name)
    def note(started):
        phases.append([label, round(time.perf_counter() - started, 2), round(time.perf_counter() - began, 1)])
    if original.__code__.co_flags & 0x80:  # a coroutine function
        async def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return await original(*args, **kwargs)
            finally:
                note(started)
    else:
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                note(started)
    setattr(owner, name, wrapper)

import patchkit
from patchkit.components import BM25Search, FaissRetriever, LlamaCppGenerator
from patchkit.scheduler.offline import engine_profile, planner, profiler
timed(planner, "_calibrate", "calibration")
timed(FaissRetriever, "setup", "calibration: retriever's setup (MiniLM, corpus, index)")
timed(BM25Search, "setup", "calibration: BM25's setup (corpus, index)")
timed(LlamaCppGenerator, "setup", "calibration: SmolLM2's load")
timed(profiler.Profiler, "run", "profiling")
timed(profiler.Profiler, "_profile", "a component's profile (in the order of `profiled`)")
timed(profiler.Profiler, "_start", "  worker start")
for step, label in (("_prompts", "1 prompts"), ("_one_at_a_time", "2 whole calls, one at a time"),
                    ("_steps", "3 decode steps"), ("_at_once", "4 whole calls at once")):
    timed(engine_profile.EngineProfile, step, "  cost model: " + label)
import {example} as example
plan = patchkit.plan(example.pipeline, calibration=[{{"question": q}} for q in example.QUESTIONS[:{questions}]])
print(json.dumps({{"seconds": time.perf_counter() - began, "phases": phases, "plan": plan.to_dict()}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--example", default="crag")
    parser.add_argument("--questions", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        seeded = seed_vectors(cache)
        script = PHASES_SCRIPT.format(examples=str(EXAMPLES), example=args.example, questions=args.questions)
        load_before = os.getloadavg()[0]
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,  # noqa: S603
                              env={**os.environ, "PATCHKIT_CACHE_DIR": cache})
        if done.returncode != 0:
            raise SystemExit(f"planning {args.example} failed: {done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    lines = [line.strip() for line in done.stderr.replace("\r", "\n").splitlines()]
    result["profiled"] = [line for line in lines if line.startswith("profiled [")]
    result["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    result.update(seeded, cores=len(os.sched_getaffinity(0)))
    for label, seconds, at in result["phases"]:
        print(f"{at:7.1f} s  {seconds:6.1f} s  {label}", file=sys.stderr)
    print(*result["profiled"], f"total {result['seconds']:.1f} s, load {result['load_average_1min']}", sep="\n",
          file=sys.stderr)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
