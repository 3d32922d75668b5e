"""Offline planner benchmarks: plan accuracy and quality on a CRAG-shaped pipeline of Simulated
components, profiling wall time, MILP solve time, and planning the real examples cold and warm.

    python benchmarks/planner.py --seconds 10 --json planner.json
    python benchmarks/planner.py --real crag,ircot --questions 2 --json planning.json

- achieved / predicted: the pipeline deployed under its plan, driven to saturation by a closed loop
  of clients, against the throughput the plan predicts.
- plan quality: the same deployment against one replica per component with the default batch
  sizes, same resources, same run.
- profiling: `patchkit.plan()` wall time for the five components with an empty profile cache.
- solve: `milp.solve` on ten components with two resource types each, per solver.
- `--real`: `patchkit.plan()` of examples/crag.py and examples/ircot.py (SmolLM2, MiniLM, FAISS)
  with their first `--questions` questions as calibration, each in a fresh process: cold (an empty
  profile cache; the corpus embeddings, which are no part of planning, copied in or built first and
  timed apart), then warm (the same cache, a new process: what `patchkit serve --plan auto` does
  after `patchkit plan`); the cost model's error against measured whole calls; the machine's load.
  `--patchkit DIR` plans with the patchkit in DIR instead (an older checkout, for the figures before).

Every component sleeps its batch time (as a GPU or a remote store would), so a 2-core machine can
host a declared pool of 8 CPUs and 2 GPUs; the front-end's own CPU is the only real cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime import load, report  # noqa: E402

import patchkit  # noqa: E402
from patchkit.components.testing import Simulated  # noqa: E402
from patchkit.scheduler.offline.milp import solve  # noqa: E402
from patchkit.scheduler.offline.problem import Option, Problem  # noqa: E402
from patchkit.scheduler.offline.pwl import PiecewiseLinear  # noqa: E402

POOL = {"cpu": 8, "gpu": 2}
# A quarter of the questions fail the grade and take the rewrite + web search branch.
QUESTIONS = [f"question {i}" + ("!" if i % 4 == 0 else "?") for i in range(16)]


def generator_ms(b: int) -> float:
    return 20.0 if b <= 32 else 20.0 + 0.6 * (b - 32)  # flat until the GPU saturates, as vLLM's


def crag() -> patchkit.Pipeline:
    retriever = Simulated(lambda b: 4.0 + 1.0 * b)
    grader = Simulated(lambda b: 2.0 * b, max_batch=32, output=lambda q: not q.endswith("!"))
    rewriter = Simulated(lambda b: 3.0 * b, max_batch=16)
    web = Simulated(lambda b: 5.0 + 0.5 * b, max_batch=32)
    generator = Simulated(generator_ms, resource="gpu", max_batch=64)
    question = QUESTIONS[0]
    with patchkit.capture(run=False) as pipeline:
        docs = retriever.run(question)
        if not grader.run(question):
            docs = web.run(rewriter.run(question))
        answer = generator.run(docs)  # noqa: F841 - the pipeline's output
    return pipeline


def saturate(pipeline: patchkit.Pipeline, seconds: float, **deploy: object) -> dict:
    bodies = json.dumps([{"inputs": {"question": q}} for q in QUESTIONS])
    with patchkit.deploy(pipeline, **deploy) as endpoint:  # type: ignore[arg-type]
        load("closed", endpoint.url, 64, 2, bodies)  # warm up
        result = load("closed", endpoint.url, 512, seconds, bodies)
        stats = endpoint.stats()
    return {
        "requests_per_s": result["ok"] / result["elapsed_s"],
        "errors": result["errors"],
        "replicas": {name: len(c["replicas"]) for name, c in stats["components"].items()},
        "mean_batch": {name: round(c["methods"]["run"]["mean_batch"], 1) for name, c in stats["components"].items()},
    }


def bench_plan(seconds: float) -> dict:
    pipeline = crag()
    started = time.perf_counter()
    plan = patchkit.plan(pipeline, resources=POOL, calibration=[{"question": q} for q in QUESTIONS])
    profiling_s = time.perf_counter() - started
    print(plan, file=sys.stderr)
    planned = saturate(pipeline, seconds, plan=plan)
    default = saturate(pipeline, seconds, replicas=1)
    return {
        "profiling_and_solve_s": profiling_s,
        "plan": plan.to_dict(),
        "predicted_requests_per_s": plan.throughput,
        "planned": planned,
        "default_one_replica_each": default,
        "achieved_over_predicted": planned["requests_per_s"] / plan.throughput,
        "plan_over_default": planned["requests_per_s"] / default["requests_per_s"],
    }


def bench_solve(components: int = 10) -> dict:
    rng = random.Random(0)
    options = []
    for i in range(components):
        for kind, speed in (("cpu", 1.0), ("gpu", 0.2)):
            knee = rng.choice([8, 16, 32])
            base = rng.uniform(2, 20) * speed
            slope = rng.uniform(0.1, 1.0)
            curve = PiecewiseLinear((1.0, float(knee), 128.0), (base, base * 1.2, base * 1.2 + slope * (128 - knee)))
            options.append(Option(f"c{i}", kind, 1, curve, 128))
    visits = {f"c{i}": rng.choice([1.0, 1.0, 2.0, 0.5]) for i in range(components)}
    problem = Problem(tuple(options), visits, {"cpu": 32, "gpu": 8})
    times = {}
    for solver in ("highs", "gurobi"):
        try:
            started = time.perf_counter()
            solution = solve(problem, solver=solver)
            times[solver] = {"seconds": time.perf_counter() - started, "requests_per_s": solution.throughput}
        except patchkit.PlanError as exc:
            times[solver] = {"error": str(exc)}
    return times


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
# Run in a fresh process: imports the example, plans it with its first N questions, then again in the same
# process (as deploy(plan="auto") after plan() does), and prints both times and the plan.
PLAN_SCRIPT = """
import json, sys, time
sys.path.insert(0, {examples!r})
started = time.perf_counter()
import patchkit, {example} as example
calibration = [{{"question": q}} for q in example.QUESTIONS[:{questions}]]
plan = patchkit.plan(example.pipeline, calibration=calibration)
first = time.perf_counter() - started
again = patchkit.plan(example.pipeline, calibration=calibration)
second = time.perf_counter() - started - first
print(json.dumps({{"seconds": first, "again_in_process_s": second, "same_plan_again": again.to_dict() == plan.to_dict(),
                  "plan": plan.to_dict()}}))
"""


def plan_in_process(example: str, questions: int, cache: str, patchkit_dir: str | None) -> dict:
    """Plan examples/EXAMPLE.py in a new process with PATCHKIT_CACHE_DIR=cache; its seconds, plan, stderr's
    profiling lines and the load average before and after."""
    env = {**os.environ, "PATCHKIT_CACHE_DIR": cache}
    if patchkit_dir:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [patchkit_dir, env.get("PYTHONPATH")]))
    script = PLAN_SCRIPT.format(examples=str(EXAMPLES), example=example, questions=questions)
    load_before = os.getloadavg()[0]
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)  # noqa: S603
    if done.returncode != 0:
        raise RuntimeError(f"planning {example} failed: {done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    lines = [line.strip() for line in done.stderr.replace("\r", "\n").splitlines()]
    result["profiled"] = [line for line in lines if line.startswith(("profiled [", "profiling took"))]
    result["load_average_1min"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    result["model_error"] = {name: c.get("model_error") for name, c in result["plan"]["components"].items()
                             if c.get("model_error") is not None}
    return result


def seed_vectors(cache: str) -> dict:
    """The corpus embeddings the examples' retrievers need, in `cache`: copied from the user's cache with
    the corpus they embed (the pydoc corpus's text of a built-in module is read from the module as one
    process holds it, so the copy must be the one the vectors were made from), or built there (timed:
    building them is no part of planning)."""
    mine = Path(os.environ.get("PATCHKIT_CACHE_DIR", Path.home() / ".cache" / "patchkit")).expanduser()
    if (mine / "vectors").is_dir() and any((mine / "vectors").iterdir()):
        for kept in ("vectors", "corpus"):
            if (mine / kept).is_dir():
                shutil.copytree(mine / kept, Path(cache) / kept)
        return {"vectors": f"copied from {mine}, with its corpus"}
    started = time.perf_counter()
    build = "from patchkit.components import FaissRetriever; FaissRetriever('pydoc').setup()"
    subprocess.run([sys.executable, "-c", build], check=True, env={**os.environ, "PATCHKIT_CACHE_DIR": cache})  # noqa: S603
    return {"vectors": "built", "embedding_build_s": time.perf_counter() - started}


def bench_real_planning(examples: list[str], questions: int, patchkit_dir: str | None) -> dict:
    results: dict = {"cores": len(os.sched_getaffinity(0)), "questions": questions}
    for example in examples:
        with tempfile.TemporaryDirectory() as cache:
            seeded = seed_vectors(cache)
            cold = plan_in_process(example, questions, cache, patchkit_dir)
            print(f"{example} cold: {cold['seconds']:.1f} s", *cold["profiled"], sep="\n  ", file=sys.stderr)
            warm = plan_in_process(example, questions, cache, patchkit_dir)
            print(f"{example} warm: {warm['seconds']:.1f} s in a new process, {cold['again_in_process_s']:.1f} s again in "
                  "the first", file=sys.stderr)
        results[example] = {**seeded, "cold": cold, "warm": warm, "same_plan": cold["plan"] == warm["plan"]}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--real", default=None, help="plan these examples instead, cold and warm: crag,ircot")
    parser.add_argument("--questions", type=int, default=2, help="with --real: calibration questions")
    parser.add_argument("--patchkit", default=None, help="with --real: plan with the patchkit package in this folder")
    args = parser.parse_args()
    if args.real:
        report(bench_real_planning(args.real.split(","), args.questions, args.patchkit), args.json)
        return
    with tempfile.TemporaryDirectory() as cache:
        os.environ["PATCHKIT_CACHE_DIR"] = cache  # profile from scratch: the wall time is part of the result
        results = {"crag_simulated": bench_plan(args.seconds), "solve_10_components_2_types": bench_solve()}
    report(results, args.json)


if __name__ == "__main__":
    main()
