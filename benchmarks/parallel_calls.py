"""Parallel calls: a request's independent component calls overlap once deployed, measured on and off.

    python benchmarks/parallel_calls.py [--requests 16] [--delay 0.2] [--seconds 10] [--real] [--json out.json]

Part A (always): pipelines of `Stage` components that sleep their batch time, so the machine's load does
not move them, each captured inside a function and deployed twice on the default local backend, with
`parallel_calls=True` and with `parallel_calls=False`. One request at a time, alternating between the
two deployments, on inputs that never repeat: median latency of each and their ratio, and every output
checked against the other deployment's and the eager pipeline's. Then throughput at saturation: a
closed loop of clients against the first pipeline, batched, on and off.

Part B (`--real`, minutes): examples/crag.py with the grader judging each retrieved document on its own
(`[grader.grade(question, [d]) for d in docs]`), on SmolLM2 through llama.cpp, MiniLM and FAISS, deployed
with its default plan, one client, latency on and off and the answers compared.

Exits 1 when an output differs. Results and how to read them: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import patchkit
from patchkit import Component, make
from patchkit.bench import run_closed
from patchkit.components import merge_hits, sources
from patchkit.tables import text_table

ARMS = ("off", "on")  # parallel_calls=False, parallel_calls=True
PARTS = 4  # the comprehension's calls per request
MERGE_SHARE = 0.1  # a merge costs this share of a search: the target's shape is "two searches, then a cheap merge"


class Stage(Component):
    """A batched stage that sleeps `delay_s` per batch, whatever its size (as a GPU kernel takes about
    the same time for a small batch as for one item), and answers with its name around its inputs."""

    def __init__(self, name: str, delay_s: float) -> None:
        self.name = name
        self.delay_s = delay_s

    @make(batch=True, max_batch_size=64, read_only=True)
    def run(self, text: list[str]) -> list[str]:
        time.sleep(self.delay_s)
        return [f"{self.name}({t})" for t in text]

    @make(batch=True, max_batch_size=64, read_only=True)
    def merge(self, first: list[str], second: list[str]) -> list[str]:
        time.sleep(self.delay_s)
        return [f"{self.name}({a}, {b})" for a, b in zip(first, second)]


# -- the pipelines, each captured inside a function: the question (or parts) is its input -----------------


def two_searches(question: str, left: Stage, right: Stage, merger: Stage) -> str:
    with patchkit.capture():
        found_left = left.run(question)
        found_right = right.run(question)
        return merger.merge(found_left, found_right)


def comprehension(parts: list[str], embedder: Stage) -> list[str]:
    with patchkit.capture():
        return [embedder.run(part) for part in parts]


def diamond(question: str, first: Stage, left: Stage, right: Stage, last: Stage) -> str:
    with patchkit.capture():
        a = first.run(question)
        b = left.run(a)
        c = right.run(a)
        return last.merge(b, c)


def chain(question: str, first: Stage, second: Stage, third: Stage) -> str:
    with patchkit.capture():
        a = first.run(question)
        b = second.run(a)
        return third.run(b)


@dataclass(frozen=True)
class Shape:
    """One pipeline of part A: how to capture it for a delay, its i-th request's inputs, what it should gain."""

    name: str
    capture: Callable[[float], patchkit.Pipeline]
    inputs: Callable[[int], dict[str, Any]]
    ideal: float  # sequential over parallel stage time, from the stages' delays
    target: float


def _captured(body: Callable[..., Any], *args: Any) -> patchkit.Pipeline:
    """Run `body` once (its block runs eagerly: the capture) and return the pipeline it captured."""
    body(*args)
    return patchkit.last_pipeline()


def _question(i: int) -> dict[str, Any]:
    return {"question": f"question {i}"}


def _parts(i: int) -> dict[str, Any]:
    return {"parts": [f"question {i}, part {j}" for j in range(PARTS)]}


SHAPES = (
    Shape("two searches, then a merge",
          lambda d: _captured(two_searches, "question", Stage("left", d), Stage("right", d), Stage("merger", d * MERGE_SHARE)),
          _question, (2 + MERGE_SHARE) / (1 + MERGE_SHARE), 1.8),
    Shape(f"{PARTS} calls of one batch method in a comprehension",
          lambda d: _captured(comprehension, ["part"] * PARTS, Stage("embedder", d)), _parts, PARTS, 3.0),
    Shape("diamond: a; b(a), c(a); d(b, c)",
          lambda d: _captured(diamond, "question", Stage("first", d), Stage("left", d), Stage("right", d), Stage("last", d)),
          _question, 4 / 3, 1.3),
    Shape("chain of three dependent calls",
          lambda d: _captured(chain, "question", Stage("first", d), Stage("second", d), Stage("third", d)),
          _question, 1.0, 1.0),
)


# -- measuring ------------------------------------------------------------------------------------------


@contextmanager
def deployed(pipeline: patchkit.Pipeline, **options: Any) -> Iterator[dict[str, patchkit.Endpoint]]:
    """The pipeline deployed twice, parallel calls off and on, both ready before the first request."""
    with ExitStack() as stack:
        yield {arm: stack.enter_context(patchkit.deploy(pipeline, parallel_calls=arm == "on", **options)) for arm in ARMS}


def overlap_groups(pipeline: patchkit.Pipeline) -> list[str]:
    """The calls a request may have in flight together, by their labels ("left.run + right.run")."""
    graph = pipeline.graph
    return [" + ".join(graph.nodes[node].label for node in group) for group in graph.overlap_groups]


def alternate(endpoints: dict[str, patchkit.Endpoint], inputs: Sequence[dict[str, Any]]) -> dict[str, list[tuple[float, Any]]]:
    """Each request to both deployments, one at a time, the first arm alternating: (seconds, output) per arm."""
    answers: dict[str, list[tuple[float, Any]]] = {arm: [] for arm in ARMS}
    for i, request in enumerate(inputs):
        for arm in ARMS if i % 2 == 0 else ARMS[::-1]:
            start = time.perf_counter()
            output = endpoints[arm].query(**request)
            answers[arm].append((time.perf_counter() - start, output))
    return answers


def compare(answers: dict[str, list[tuple[float, Any]]], eager: Sequence[Any]) -> dict[str, Any]:
    """Median latencies, their ratio, and which requests' outputs differ between the arms or from eager."""
    p50 = {arm: statistics.median(s for s, _ in answers[arm]) for arm in ARMS}
    differ = [i for i, ((_, off), (_, on)) in enumerate(zip(answers["off"], answers["on"])) if off != on]
    not_eager = [i for i, ((_, on), ref) in enumerate(zip(answers["on"], eager)) if on != ref]
    return {"p50_ms": {arm: p50[arm] * 1000 for arm in ARMS}, "ratio": p50["off"] / p50["on"],
            "requests": len(eager), "outputs_differ": differ, "outputs_not_eager": not_eager}


def latency(shape: Shape, delay_s: float, requests: int) -> dict[str, Any]:
    """One shape: captured, its eager outputs (requests run at once, in threads), then both deployments."""
    pipeline = shape.capture(delay_s)
    inputs = [shape.inputs(i) for i in range(requests)]
    with ThreadPoolExecutor(max_workers=requests) as pool:
        eager = list(pool.map(lambda request: pipeline(**request), inputs))
    with deployed(pipeline) as endpoints:
        result = compare(alternate(endpoints, inputs), eager)
    return {"pipeline": shape.name, "overlap_groups": overlap_groups(pipeline), "ideal": shape.ideal, "target": shape.target,
            **result}


def throughput(delay_s: float, seconds: float, clients: int, batch: int) -> dict[str, Any]:
    """Closed loop of `clients` against `two_searches` with batches of at most `batch`, on and off in
    alternating halves of `seconds` each: requests answered per second of load, per arm."""
    pipeline = SHAPES[0].capture(delay_s)
    inputs = [_question(i) for i in range(100_000, 200_000)]  # not the latency runs' questions
    answered = dict.fromkeys(ARMS, 0)
    errors = dict.fromkeys(ARMS, 0)
    with deployed(pipeline, batch_size=batch) as endpoints:
        for round_ in range(2):
            for arm in ARMS if round_ == 0 else ARMS[::-1]:
                summary = run_closed(endpoints[arm].url, concurrency=clients, seconds=seconds / 2, inputs=inputs).summary()
                answered[arm] += round(summary["throughput"] * seconds / 2)
                errors[arm] += summary["errors"]
        mean_batch = {arm: endpoints[arm].stats()["components"]["left"]["methods"]["run"]["mean_batch"] for arm in ARMS}
    rate = {arm: answered[arm] / seconds for arm in ARMS}
    return {"clients": clients, "batch": batch, "seconds": seconds, "req_per_s": rate, "errors": errors,
            "ratio": rate["on"] / rate["off"], "bound_req_per_s": batch / delay_s, "mean_batch": mean_batch}


# -- part B: CRAG, every retrieved document graded on its own --------------------------------------------


MORE_QUESTIONS = (
    "How do I read a JSON file into a dictionary?",
    "Which module finds files matching a wildcard pattern?",
    "How do I sort a list of tuples by the second item?",
    "What does the yield from expression do?",
    "Which module runs another program and reads its output?",
    "How do I count how often each word occurs in a list?",
    "What is a lambda expression?",
    "Which module generates random numbers?",
)


def crag_each_document(question: str, retriever: Any, grader: Any, rewriter: Any, web: Any, llm: Any) -> dict[str, Any]:
    with patchkit.capture(run=False):  # nothing loads here: the eager references run later
        docs = retriever.retrieve(question)
        verdicts = [grader.grade(question, [d]) for d in docs]
        relevant = any(verdicts)
        if not relevant:
            docs = merge_hits(docs, web.search(rewriter.rewrite(question)))
        answer = llm.generate(question, docs)
        return {"answer": answer, "sources": sources(docs), "graded_relevant": relevant}


def crag_latency(questions: Sequence[str]) -> dict[str, Any]:
    """examples/crag.py's components, each document graded apart, deployed with the default plan."""
    from patchkit.components import BM25Search, FaissRetriever, Grader, LlamaCppGenerator, Rewriter

    llm = LlamaCppGenerator(max_tokens=64)
    crag_each_document("question", FaissRetriever("pydoc", topk=3), Grader(llm), Rewriter(llm), BM25Search("pydoc", topk=3), llm)
    pipeline = patchkit.last_pipeline()
    start = time.perf_counter()
    with deployed(pipeline) as endpoints:
        ready_s = time.perf_counter() - start
        alternate(endpoints, [{"question": "What is a decorator?"}])  # warm-up: models' first calls
        answers = alternate(endpoints, [{"question": q} for q in questions])
        methods = {arm: _methods(endpoints[arm].stats()) for arm in ARMS}
    eager = [pipeline(question=q) for q in questions]
    result = compare(answers, eager)
    return {"pipeline": "crag, each document graded apart", "overlap_groups": overlap_groups(pipeline), "deploy_both_s": ready_s,
            "graded_relevant": sum(output["graded_relevant"] for _, output in answers["on"]),
            "latency_s": {arm: [s for s, _ in answers[arm]] for arm in ARMS}, "methods": methods, **result}


def _methods(stats: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per called method of a deployment's stats: calls, mean batch (calls at once), mean batch time; the replica's threads."""
    return {f"{name}.{method}": {"calls": m["calls"], "mean_batch": m["mean_batch"], "mean_batch_ms": m["mean_batch_ms"],
                                 "threads": component["replicas"][0]["resources"]["threads"]}
            for name, component in stats["components"].items() for method, m in component["methods"].items() if m["calls"]}


# -- the report ---------------------------------------------------------------------------------------------


def _outputs(row: dict[str, Any]) -> str:
    bad = len(set(row["outputs_differ"]) | set(row["outputs_not_eager"]))
    return f"{row['requests'] - bad}/{row['requests']} same"


def latency_table(rows: Sequence[dict[str, Any]]) -> str:
    header = ("pipeline", "in flight together", "off p50 ms", "on p50 ms", "off/on", "ideal", "target", "outputs")
    return text_table(header, [
        (row["pipeline"], "; ".join(row["overlap_groups"]) or "-", f"{row['p50_ms']['off']:.1f}", f"{row['p50_ms']['on']:.1f}",
         f"{row['ratio']:.2f}x", f"{row['ideal']:.2f}x", f">= {row['target']:.1f}x" if row["target"] > 1 else "no loss",
         _outputs(row))
        for row in rows
    ])


def throughput_table(row: dict[str, Any]) -> str:
    header = ("load", "off req/s", "on req/s", "on/off", "bound req/s", "mean batch off/on", "errors off/on")
    load = f"{row['clients']} clients, two searches then a merge, batches <= {row['batch']}, {row['seconds']:g} s per arm"
    return text_table(header, [(load, f"{row['req_per_s']['off']:.1f}", f"{row['req_per_s']['on']:.1f}",
                                f"{row['ratio']:.3f}", f"{row['bound_req_per_s']:.0f}",
                                f"{row['mean_batch']['off']:.2f}/{row['mean_batch']['on']:.2f}",
                                f"{row['errors']['off']}/{row['errors']['on']}")])


def real_table(row: dict[str, Any]) -> str:
    header = ("pipeline", "in flight together", "off p50 s", "on p50 s", "off/on", "off mean s", "on mean s", "outputs")
    mean = {arm: statistics.fmean(row["latency_s"][arm]) for arm in ARMS}
    return text_table(header, [(row["pipeline"], "; ".join(row["overlap_groups"]) or "-", f"{row['p50_ms']['off'] / 1000:.2f}",
                                f"{row['p50_ms']['on'] / 1000:.2f}", f"{row['ratio']:.2f}x", f"{mean['off']:.2f}",
                                f"{mean['on']:.2f}", _outputs(row))])


def methods_table(row: dict[str, Any]) -> str:
    header = ("method", "threads", "calls off/on", "mean batch off/on", "mean batch ms off/on")
    idle = {"calls": 0, "mean_batch": 0.0, "mean_batch_ms": 0.0, "threads": 0}
    rows = []
    for name in sorted(set(row["methods"]["off"]) | set(row["methods"]["on"])):
        off, on = (row["methods"][arm].get(name, idle) for arm in ARMS)
        rows.append((name, str(max(off["threads"], on["threads"])), f"{off['calls']}/{on['calls']}",
                     f"{off['mean_batch']:.2f}/{on['mean_batch']:.2f}", f"{off['mean_batch_ms']:.0f}/{on['mean_batch_ms']:.0f}"))
    return text_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16, help="requests per pipeline and arm (part A)")
    parser.add_argument("--delay", type=float, default=0.2, help="seconds a stage sleeps per batch (part A)")
    parser.add_argument("--seconds", type=float, default=10.0, help="seconds of closed-loop load per arm (part A)")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients (part A)")
    parser.add_argument("--batch", type=int, default=8, help="largest batch in the throughput run (part A)")
    parser.add_argument("--real", action="store_true", help="also part B: CRAG on real models (minutes)")
    parser.add_argument("--questions", type=int, default=16, help="questions of part B (at most 16)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.delay < 0 or args.seconds <= 0 or not 1 <= args.questions <= 16:
        parser.error("--requests must be >= 1, --delay >= 0, --seconds > 0 and --questions within 1..16")

    rows = [latency(shape, args.delay, args.requests) for shape in SHAPES]
    print(f"Latency, one request at a time, {args.requests} requests per arm, stages sleeping {args.delay * 1000:g} ms:")
    print(latency_table(rows))
    saturated = throughput(args.delay, args.seconds, args.clients, args.batch)
    print("\nThroughput at saturation (closed loop):")
    print(throughput_table(saturated))
    results: dict[str, Any] = {"latency": rows, "throughput": saturated}
    if args.real:
        from patchkit.examples.crag import QUESTIONS

        crag = crag_latency([*QUESTIONS, *MORE_QUESTIONS][: args.questions])
        print(f"\nCRAG, each document graded apart, one client, {crag['requests']} questions:")
        print(real_table(crag))
        print(methods_table(crag))
        results["real"] = crag
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    checked = [*rows, *([results["real"]] if args.real else [])]
    failed = [row["pipeline"] for row in checked if row["outputs_differ"] or row["outputs_not_eager"]]
    if failed:
        print(f"\noutputs differ in: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
