"""The default path against plain Python: examples/crag.py deployed with no plan, on new questions.

    python benchmarks/unplanned.py --json unplanned-raw.json
    python benchmarks/unplanned.py --json run1.json,run2.json --result benchmarks/results/unplanned.json

Two arms, each a fresh process on the example's own components (MiniLM + FAISS, BM25, SmolLM2-135M
in llama.cpp), each first answering one untimed question (the models load there, not in the timing):

- `plain`: `pipeline(question=...)` for each of `QUESTIONS` one after another, in the process: the
  same code run as plain Python, what a user has before deploying;
- `deployed`: `patchkit.deploy(pipeline)` with no plan (the machine's defaults,
  `patchkit/config/machine.py`), every question of `QUESTIONS` sent at once (`endpoint.query` from a
  thread each), the time from the first sent to the last answered.

`QUESTIONS` are not the example's own. The raw file (`--json`) holds each arm's seconds, the plan the
deployment served (`GET /v1/plan`), the answers (greedy decoding: the same as plain's), the setup time
(model loads, or workers started), and the 1-minute load average before and after each arm; `--result`
writes the site's result file from it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

QUESTIONS = (
    "How do I read a text file line by line?",
    "What does a lambda expression create?",
    "Which module matches text against regular expressions?",
    "How do I sort a list of dictionaries by one of their keys?",
    "Which module copies and removes whole directory trees?",
    "What happens when a function has no return statement?",
    "Which module turns Python objects into bytes and back?",
    "How do I format a float with two decimal places?",
)
WARMUP = "What is a tuple?"


def run_plain() -> dict[str, Any]:
    """The example's pipeline as plain Python, one question after another, in this process."""
    from examples import crag

    began = time.perf_counter()
    crag.pipeline(question=WARMUP)
    setup_s = time.perf_counter() - began
    began = time.perf_counter()
    outputs = [crag.pipeline(question=q) for q in QUESTIONS]
    return {"seconds": time.perf_counter() - began, "setup_s": setup_s, "outputs": outputs}


def run_deployed() -> dict[str, Any]:
    """The example deployed with no plan; every question at once, each from a thread of its own."""
    import patchkit
    from examples import crag

    began = time.perf_counter()
    with patchkit.deploy(crag.pipeline) as endpoint:
        endpoint.query(question=WARMUP)
        setup_s = time.perf_counter() - began
        plan = endpoint.plan()
        with ThreadPoolExecutor(len(QUESTIONS)) as pool:
            began = time.perf_counter()
            outputs = list(pool.map(lambda q: endpoint.query(question=q), QUESTIONS))
            seconds = time.perf_counter() - began
    return {"seconds": seconds, "setup_s": setup_s, "outputs": outputs, "plan": dict(plan)}


def run_arm(arm: str) -> dict[str, Any]:
    """`arm` in a fresh process (this script with `--arm`), with the load average around it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "HF_HUB_OFFLINE": "1"}
    load_before = os.getloadavg()[0]
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--arm", arm], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, text=True, check=True)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    found["load"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    print(f"{arm}: {len(QUESTIONS)} questions in {found['seconds']:.1f} s (setup {found['setup_s']:.0f} s), load "
          f"{found['load'][0]:.1f}-{found['load'][1]:.1f}", file=sys.stderr)
    return found


def result_file(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """benchmarks/results/unplanned.json: what the site draws, from one or more runs' raw results."""
    names = {"plain": "plain Python, one after another", "deployed": "deploy(pipeline), no plan, all at once"}
    rows = []
    for number, found in enumerate(runs, 1):
        plain = found["arms"]["plain"]["seconds"]
        rows += [[str(number), names[arm], f"{a['seconds']:.1f}", f"{len(found['questions']) / a['seconds']:.3f}",
                  f"{plain / a['seconds']:.2f}x", f"{a['setup_s']:.0f}", f"{a['load'][0]:.1f}-{a['load'][1]:.1f}"]
                 for arm, a in found["arms"].items()]
    found = runs[0]
    plan = found["arms"]["deployed"]["plan"].get("plan") or {}
    layout = ", ".join(f"{name} {part['replicas']} x {part['threads']} thread ({part['units']}/8 core)"
                       for name, part in plan.get("components", {}).items())
    identical = ", ".join(f"{r.get('identical_outputs', '-')}/{len(r['questions'])}" for r in runs)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {
        "title": "The default path against plain Python: examples/crag.py deployed with no plan",
        "components": "real models",
        "machine": f"{found['cores']} cores, shared with other work (load averages in the table)",
        "date": found["date"][:10],
        "commit": commit,
        "command": "python benchmarks/unplanned.py",
        "setup": f"examples/crag.py's components (MiniLM + FAISS, BM25, SmolLM2-135M in llama.cpp, greedy), "
                 f"{len(found['questions'])} questions not in the example's list; each arm a fresh process after one "
                 f"untimed question. The deployment's layout, from the cores: {layout or 'not recorded'}. "
                 f"Outputs identical to plain Python's, per run: {identical}.",
        "tables": [{"caption": "Seconds for the questions (setup, untimed: model loads or workers started and one "
                               "question). Load: the 1-minute load average before and after the arm.",
                    "columns": ["run", "arm", "seconds", "questions/s", "vs plain", "setup s", "load"], "rows": rows}],
        "plots": [{"title": "Questions per second, per run", "kind": "bar", "ylabel": "questions/s",
                   "x": [f"run {i}" for i in range(1, len(runs) + 1)],
                   "series": {names[arm]: [round(len(r["questions"]) / r["arms"][arm]["seconds"], 3) for r in runs]
                              for arm in found["arms"]}}],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="plain,deployed", help="comma-separated, from plain, deployed")
    parser.add_argument("--json", default="unplanned-raw.json", help="the raw results (with --result: "
                        "one or more runs' files, comma-separated)")
    parser.add_argument("--result", help="write the site's result file here from --json, and stop")
    parser.add_argument("--arm", choices=("plain", "deployed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_plain() if args.arm == "plain" else run_deployed(), default=str))
        return
    if args.result:
        runs = [json.loads(Path(path).read_text()) for path in args.json.split(",")]
        Path(args.result).write_text(json.dumps(result_file(runs), indent=1) + "\n")
        return
    found: dict[str, Any] = {"questions": list(QUESTIONS), "cores": len(os.sched_getaffinity(0)),
                             "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "arms": {}}
    for arm in args.arms.split(","):
        found["arms"][arm] = run_arm(arm)
        Path(args.json).write_text(json.dumps(found, indent=1, default=str) + "\n")
    arms = found["arms"]
    if {"plain", "deployed"} <= set(arms):
        same = sum(a == b for a, b in zip(arms["plain"]["outputs"], arms["deployed"]["outputs"]))
        found["identical_outputs"] = same
        found["plain_over_deployed"] = arms["plain"]["seconds"] / arms["deployed"]["seconds"]
        print(f"deployed / plain speed: {found['plain_over_deployed']:.2f}x; {same}/{len(QUESTIONS)} outputs identical",
              file=sys.stderr)
    Path(args.json).write_text(json.dumps(found, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
