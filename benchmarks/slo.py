"""SLO policy benchmarks: violations with the policies on and off, their throughput cost, and a load
step that doubles the rate.

    python benchmarks/slo.py --seconds 20 --json slo.json --plot slo.png

Pipeline: Simulated components with high runtime variance: CRAG's branch (a quarter of the
questions fail the grade and take rewrite + web search) and an IRCoT-shaped loop whose round count
(1 to 4) depends on the question. It is planned for a declared pool, deployed under the plan with
worker processes, and driven open-loop (`patchkit bench`, Poisson) at 50% to 120% of the planned
capacity. The SLO is twice the mean latency at low load (Patchwork's definition), measured first.

Four deployments per load, same arrivals: "off" (no policy); "on" (the defaults: prioritisation
and autoscaling, but the plan uses the whole pool, so the autoscaler finds no free unit); "on+room"
(the defaults on a machine offering twice the plan's pool: the autoscaler may add replicas); "all"
(as on+room, with admission pausing too).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from runtime import arguments, report  # noqa: E402

import patchkit  # noqa: E402
from patchkit.bench import run_bench  # noqa: E402
from patchkit.components.testing import Simulated  # noqa: E402
from patchkit.scheduler.online.averages import RunningAverage  # noqa: E402
from patchkit.scheduler.online.estimator import accuracy  # noqa: E402
from patchkit.scheduler.online.traces import Trace  # noqa: E402
from patchkit.scheduler.online.xgb import XGBoostEstimator  # noqa: E402
from patchkit.tables import text_table  # noqa: E402

POOL = {"cpu": 6, "gpu": 1}
QUESTIONS = [f"question {i}" + ("!" if i % 4 == 0 else "?") for i in range(32)]
LOADS = (0.5, 0.7, 0.9, 1.0, 1.2)
TRACED_LOAD = 0.9  # the run whose finished requests both estimators are scored on
POLICIES = ("on", "on+room", "all")  # each compared with "off"
OFF = {"prioritize": False, "pause_admission": False, "autoscale": False}


def rounds(question: str) -> int:
    return int(question.rstrip("?!").split()[-1]) % 4 + 1


def generator_ms(b: int) -> float:
    return 15.0 if b <= 8 else 15.0 + 1.5 * (b - 8)


def pipeline() -> patchkit.Pipeline:
    retriever = Simulated(lambda b: 3.0 + 0.5 * b)
    grader = Simulated(lambda b: 2.0 * b, max_batch=16, output=lambda q: not q.endswith("!"))
    rewriter = Simulated(lambda b: 4.0 * b, max_batch=8)
    web = Simulated(lambda b: 8.0 + 0.5 * b, max_batch=16)
    generator = Simulated(generator_ms, resource="gpu", max_batch=32)
    judge = Simulated(lambda b: 1.0 + 0.1 * b, output=lambda step: step[1] + 1 >= rounds(step[0]))
    question = QUESTIONS[1]
    with patchkit.capture(run=False) as captured:
        docs = retriever.run(question)
        if not grader.run(question):
            docs = web.run(rewriter.run(question))
        thought = generator.run(docs)
        step = 0
        while not judge.run((question, step)):
            thought = generator.run(thought)
            step += 1
        answer = thought  # noqa: F841 - the pipeline's output
    return captured


def estimator_accuracy(traces: list[Trace]) -> dict[str, Any]:
    """Both estimators on the same deployment trace: learn from its first 60%, score on the rest."""
    cut = int(0.6 * len(traces))
    learnt, held_out = traces[:cut], traces[cut:]
    average = RunningAverage()
    for trace in learnt:
        average.observe(trace)
    boosted = XGBoostEstimator(background=False)
    boosted.fit(learnt)
    scores = {"average": accuracy(average, held_out), "xgboost": accuracy(boosted, held_out)}
    return {"traces_learnt": len(learnt), "traces_scored": len(held_out), **scores}


def drive(endpoint: patchkit.Endpoint, rate: float, seconds: float, slo_ms: float | None, **extra: Any) -> dict[str, Any]:
    inputs = [{"question": q} for q in QUESTIONS]
    result = run_bench(endpoint.url, rate=rate, seconds=seconds, inputs=inputs, slo_ms=slo_ms, **extra)
    summary = result.summary()
    return {
        "rate": rate,
        "throughput": summary["throughput"],
        "slo_attainment": summary["slo_attainment"],
        "violations": 1 - (summary["slo_attainment"] or 0.0),
        "mean_ms": summary["latency_ms"]["mean"],
        "p50_ms": summary["latency_ms"]["p50"],
        "p99_ms": summary["latency_ms"]["p99"],
        "errors": summary["errors"],
        "slo": endpoint.stats()["slo"],
    }


def roomy(plan: patchkit.Plan) -> patchkit.Plan:
    """The plan, on a machine that offers twice the pool it was made for: room for the autoscaler."""
    return dataclasses.replace(plan, capacity={kind: 2 * units for kind, units in plan.capacity.items()})


def bench_policies(plan: patchkit.Plan, seconds: float) -> dict[str, Any]:
    captured = pipeline()
    capacity = plan.throughput
    with patchkit.deploy(captured, plan=plan, **OFF) as endpoint:
        low = drive(endpoint, 0.1 * capacity, seconds, None)
    slo_ms = 2 * low["mean_ms"]
    scaling = {"autoscale_interval_s": 0.5}
    variants = {
        "off": (plan, OFF), "on": (plan, {}), "on+room": (roomy(plan), scaling),
        "all": (roomy(plan), {**scaling, "pause_admission": True}),
    }
    rows, traces = [], []
    for load in LOADS:
        row: dict[str, Any] = {"load": load}
        for label, (deployed, options) in variants.items():
            with patchkit.deploy(captured, plan=deployed, slo_ms=slo_ms, **options) as endpoint:
                row[label] = drive(endpoint, load * capacity, seconds, slo_ms)
                if load == TRACED_LOAD and label == "on":
                    traces = endpoint.traces()
        off = row["off"]["violations"]
        for label in POLICIES:
            row[label]["fewer_violations"] = (off - row[label]["violations"]) / off if off else 0.0
            row[label]["throughput_cost"] = 1 - row[label]["throughput"] / row["off"]["throughput"]
        rows.append(row)
    return {
        "capacity": capacity, "low_load_mean_ms": low["mean_ms"], "slo_ms": slo_ms, "loads": rows,
        "estimators": {"load": TRACED_LOAD, **estimator_accuracy(traces)},
    }


def table(policies: dict[str, Any]) -> str:
    """Violations and throughput per load: off and each policy set, and the changes against off."""
    labels = ("off", *POLICIES)
    header = ["load", f"violations {' / '.join(labels)}", f"fewer {' / '.join(POLICIES)}", f"req/s {' / '.join(labels)}"]
    rows = []
    for row in policies["loads"]:
        rows.append([
            f"{row['load']:.0%}",
            " / ".join(f"{row[k]['violations']:.3f}" for k in labels),
            " / ".join(f"{row[k]['fewer_violations']:.0%}" for k in POLICIES),
            " / ".join(f"{row[k]['throughput']:.0f}" for k in labels),
        ])
    scores = policies["estimators"]
    accuracy = ", ".join(f"{name} MAE {scores[name]['mae_s'] * 1000:.1f} ms" for name in ("average", "xgboost"))
    return (f"SLO {policies['slo_ms']:.0f} ms (2x the mean at 10% load)\n{text_table(header, rows)}\n"
            f"estimators on the {scores['load']:.0%} load trace ({scores['traces_scored']} requests held out): {accuracy}")


def bench_step(plan: patchkit.Plan, slo_ms: float, seconds: float, plot: str | None) -> dict[str, Any]:
    rate = 0.6 * plan.throughput
    schedule = f"0:{rate:.0f},{seconds / 3:.0f}:{2 * rate:.0f}"
    with patchkit.deploy(pipeline(), plan=roomy(plan), slo_ms=slo_ms, autoscale_interval_s=0.5) as endpoint:
        inputs = [{"question": q} for q in QUESTIONS]
        result = run_bench(endpoint.url, schedule=schedule, seconds=seconds, inputs=inputs, slo_ms=slo_ms)
        slo = endpoint.stats()["slo"]
    if plot:
        result.plot(plot)
    return {"schedule": schedule, "summary": result.summary(), "steps": result.steps(), "slo": slo}


def main() -> None:
    args = arguments()
    plan = patchkit.plan(
        pipeline(), resources=POOL, calibration=[{"question": q} for q in QUESTIONS], progress=False
    )
    print(plan, file=sys.stderr)
    policies = bench_policies(plan, args.seconds)
    print(table(policies), file=sys.stderr)
    step = bench_step(plan, policies["slo_ms"], 3 * args.seconds, args.plot)
    report({"plan": plan.to_dict(), "policies": policies, "load_step": step}, args.json)


if __name__ == "__main__":
    main()
