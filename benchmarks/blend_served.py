"""Blend served: the exact engine and `kv_reuse="blend"` each deployed in a fresh process, over the same
question stream, side by side.

    PYTHONPATH=. python benchmarks/blend_served.py --stream topics --count 16 --clients 4 --json served.json

Streams (question_stream.py's questions about the pydoc corpus, each with its top 3 chunks from MiniLM
over FAISS, retrieved once up front so that both arms read the same prompts): `topics`, new questions
about a few modules, whose documents recur in new orders; `fresh`, questions chosen so that no
document recurs; `zipf`, rag_stream's stream (new questions over Zipf-popular modules, s = 1).
Each arm runs in a subprocess of its own: `llm.generate(question, docs)` captured and deployed on
the default backend, one warm-up question, then the stream sent `--clients` at a time through the
HTTP endpoint, streamed (time to first token). Reported per arm: questions/s, the
median time to first token and latency, the engine's prompt tokens evaluated and placing counters,
and against the exact arm: answers identical and ROUGE-L. Beside them, the replay's ceiling
(`prefix_replay.py` over the same prompts on engines like the exact arm's): the prompt tokens each arm's
reuse rules evaluate at best, and the speed-up over exact they allow. The exact answer's NLL needs the
engine's logits, which a deployment does not return: `blend_quality.py` measures it on the engine itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.blend_quality import rouge_l  # noqa: E402
from benchmarks.rag_stream import engine_counters  # noqa: E402

SEED_QUESTION, SEED_DOCS = "What is the json module for?", ["json: The json module encodes and decodes JSON."]


def stream(kind: str, count: int, modules: int, seed: int) -> list[dict[str, Any]]:
    """`count` questions with their documents' texts: about `modules` modules (`topics`), none of
    whose documents recurs (`fresh`), or over Zipf-popular modules (`zipf`)."""
    import random

    from benchmarks.question_stream import catalogue
    from benchmarks.rag_stream import PlainRetriever
    from patchkit.components.documents import pydoc_corpus

    docs = pydoc_corpus()
    retrieve = PlainRetriever(docs, 3)
    questions = catalogue({d.title for d in docs if d.id.startswith("module:")}, seed=seed)
    rng = random.Random(seed)
    names = sorted(m for m, qs in questions.items() if len(qs) >= 12)
    chosen: list[dict[str, Any]] = []
    seen: set[str] = set()
    if kind == "topics":
        pool = [q for m in rng.sample(names, modules) for q in questions[m][1:]]
        rng.shuffle(pool)
        for q in pool[:count]:
            chosen.append({"question": q.text, "docs": [f"{d.title}: {d.text}" for d in retrieve(q.text)]})
        return chosen
    if kind == "zipf":  # rag_stream's: new questions over Zipf-popular modules (s = 1)
        from benchmarks.question_stream import draw

        return [{"question": q.text, "docs": [f"{d.title}: {d.text}" for d in retrieve(q.text)]}
                for q in draw(questions, count, s=1.0, seed=seed)]
    pool = [q for m in names for q in questions[m]]
    rng.shuffle(pool)
    for q in pool:
        found = retrieve(q.text)
        if seen.isdisjoint(d.id for d in found):
            seen.update(d.id for d in found)
            chosen.append({"question": q.text, "docs": [f"{d.title}: {d.text}" for d in found]})
            if len(chosen) == count:
                break
    return chosen


def ask(url: str, item: dict[str, Any]) -> dict[str, Any]:
    """One streamed query: its answer, time to first token and latency."""
    import httpx

    began, first, output = time.perf_counter(), None, None
    body = {"inputs": {"question": item["question"], "docs": item["docs"]}, "stream": True}
    with httpx.stream("POST", url + "/v1/query", json=body, timeout=600) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if "delta" in event and first is None:
                first = time.perf_counter() - began
            if "output" in event:
                output = event["output"]
    latency = time.perf_counter() - began
    return {"answer": output, "ttft_s": first if first is not None else latency, "latency_s": latency}


def arm(kv_reuse: str, items: list[dict[str, Any]], clients: int, max_tokens: int, threads: int) -> dict[str, Any]:
    """Deploy one arm here and run the stream through it (the subprocess's work)."""
    import patchkit
    from patchkit.components.generators import LlamaCppGenerator

    llm = LlamaCppGenerator(max_tokens=max_tokens, threads=threads, kv_reuse=kv_reuse)

    def answer(question: str, docs: list[str]) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return llm.generate(question, docs)  # type: ignore[no-any-return]
        return pipeline

    with patchkit.deploy(answer(SEED_QUESTION, SEED_DOCS)) as endpoint:
        ask(endpoint.url, {"question": SEED_QUESTION, "docs": SEED_DOCS})
        results: list[dict[str, Any]] = [{} for _ in items]
        cursor, lock = iter(range(len(items))), threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    i = next(cursor, None)
                if i is None:
                    return
                results[i] = ask(endpoint.url, items[i])

        began = time.perf_counter()
        workers = [threading.Thread(target=client) for _ in range(clients)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        wall = time.perf_counter() - began
        stats = engine_counters(endpoint, "llm")
        replicas = sum(r.get("component") == "llm" for r in endpoint.stats().get("replica_reports", {}).values())
    return {"wall_s": wall, "questions_per_s": len(items) / wall, "results": results, "stats": stats, "replicas": replicas}


def ceiling(items: list[dict[str, Any]], runs: dict[str, Any]) -> dict[str, float]:
    """The replay beside the served run (`prefix_replay.py`, after the arms, in this process): the prompt tokens
    the exact and blend engines' reuse rules evaluate on the stream with prompts one at a time (none evaluated
    twice because another was in flight), each routed by its first document, and no byte budget, on engines
    like the exact arm's; and the speed-up those tokens allow at the exact arm's measured prompt rate and
    decode seconds: what blend can gain served by evaluating less (a single run spreads around it)."""
    from benchmarks.prefix_replay import item_prompts, replay
    from patchkit.components.generators.llama.generator import RECOMPUTE

    stats, replicas = runs["exact"]["stats"], max(1, int(runs["exact"]["replicas"]))
    fleet = {"engines": replicas, "documents": True, "block": int(stats["block"]) // replicas,
             "slots": int(stats["sequence_slots"] + stats["cache_slots"]) // replicas}
    prompts = item_prompts(items)
    exact, blend = sum(replay(prompts, **fleet)), sum(replay(prompts, blend=RECOMPUTE, **fleet))
    rate = stats["prompt_tokens_evaluated"] / stats["prefill_s"]
    return {"exact_tokens": exact, "blend_tokens": blend, "prompt_tok_s": rate, "decode_s": stats["decode_s"],
            "speedup": (exact / rate + stats["decode_s"]) / (blend / rate + stats["decode_s"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stream", choices=("topics", "fresh", "zipf"), default="topics")
    parser.add_argument("--count", type=int, default=16)
    parser.add_argument("--modules", type=int, default=3, help="modules a topics stream asks about")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--result", help="write a benchmarks/results/ file here")
    parser.add_argument("--items", help="a stream written by --save-items (else built here)")
    parser.add_argument("--save-items", help="write the stream here and stop (build it outside a timed run)")
    parser.add_argument("--arm", help=argparse.SUPPRESS)  # the subprocess: run this arm over --items
    args = parser.parse_args()
    if args.arm:
        items = json.loads(Path(args.items).read_text())
        found = arm(args.arm, items, args.clients, args.max_tokens, args.threads)
        Path(args.items + "." + args.arm).write_text(json.dumps(found))  # the parent reads it
        return
    items = json.loads(Path(args.items).read_text()) if args.items else stream(args.stream, args.count, args.modules,
                                                                               args.seed)
    if args.save_items:
        Path(args.save_items).write_text(json.dumps(items))
        return
    folder = tempfile.TemporaryDirectory()
    path = Path(folder.name) / "items.json"
    path.write_text(json.dumps(items))
    runs: dict[str, Any] = {}
    for name in ("exact", "blend"):
        load = os.getloadavg()
        subprocess.run([sys.executable, __file__, "--arm", name, "--items", str(path), "--clients", str(args.clients),
                        "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)], check=True)
        runs[name] = json.loads(Path(f"{path}.{name}").read_text())
        runs[name]["load_before"] = load
        runs[name]["load_after"] = os.getloadavg()
    exact = [r["answer"] for r in runs["exact"]["results"]]
    print(f"\n{len(items)} {args.stream} questions, {args.clients} at once, answers of up to {args.max_tokens} tokens\n")
    print("| engine | questions/s (vs exact) | TTFT median s | latency median s | identical | ROUGE-L vs exact "
          "| prompt tokens evaluated | load (1 min) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, run in runs.items():
        answers = [r["answer"] for r in run["results"]]
        run["identical"] = sum(a == b for a, b in zip(answers, exact))
        run["rouge_l"] = statistics.fmean(rouge_l(str(a), str(b)) for a, b in zip(answers, exact))
        print(f"| {name} | {run['questions_per_s']:.3f} ({run['questions_per_s'] / runs['exact']['questions_per_s']:.2f}x) "
              f"| {statistics.median(r['ttft_s'] for r in run['results']):.2f} "
              f"| {statistics.median(r['latency_s'] for r in run['results']):.2f} | {run['identical']}/{len(items)} "
              f"| {run['rouge_l']:.3f} | {run['stats'].get('prompt_tokens_evaluated', 0):,.0f} "
              f"| {run['load_before'][0]:.1f} -> {run['load_after'][0]:.1f} |")
    bound = ceiling(items, runs)
    print(f"\nThe replay's ceiling (prompts one at a time, no byte budget): exact {bound['exact_tokens']:,} and blend "
          f"{bound['blend_tokens']:,} prompt tokens: blend's tokens allow {bound['speedup']:.2f}x exact at the exact arm's "
          f"{bound['prompt_tok_s']:.0f} prompt tokens/s and {bound['decode_s']:.0f} s of decoding")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "items": items, "runs": runs, "ceiling": bound},
                                              indent=1))
    if args.result:
        Path(args.result).write_text(json.dumps(result_file(args, len(items), runs, bound), indent=1))


def result_file(args: argparse.Namespace, count: int, runs: dict[str, Any], bound: dict[str, float]) -> dict[str, Any]:
    """The run as a benchmarks/results/ file: provenance, its table and a plot (the docs draw it)."""
    import platform

    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    loads = [f"{run['load_before'][0]:.1f}-{run['load_after'][0]:.1f}" for run in runs.values()]
    base = runs["exact"]
    rows = [[name, f"{run['questions_per_s']:.3f}", f"{run['questions_per_s'] / base['questions_per_s']:.2f}x",
             f"{statistics.median(r['ttft_s'] for r in run['results']):.2f}",
             f"{statistics.median(r['latency_s'] for r in run['results']):.2f}", f"{run['identical']}/{count}",
             f"{run['rouge_l']:.3f}", f"{run['stats'].get('prompt_tokens_evaluated', 0):,.0f}"] for name, run in runs.items()]
    rows.append(["blend, replayed (the ceiling)", "", f"{bound['speedup']:.2f}x", "", "", "", "", f"{bound['blend_tokens']:,}"])
    return {
        "title": f"kv_reuse='blend' served against exact: the {args.stream} stream",
        "components": "real models",
        "machine": f"{model}, {os.cpu_count()} vCPUs shared with other work, load average {' and '.join(loads)} "
                   f"(exact, blend), Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"), "commit": commit,
        "command": f"python benchmarks/blend_served.py --stream {args.stream} --count {args.count} "
                   f"--clients {args.clients} --max-tokens {args.max_tokens} --result ...",
        "setup": f"SmolLM2-135M-Instruct Q4_1 in LlamaCppGenerator (threads={args.threads}), "
                 "llm.generate(question, docs) deployed on the default backend, each arm in a fresh process, "
                 f"{count} questions with their top 3 pydoc chunks (MiniLM over FAISS), {args.clients} at once, "
                 "streamed through the HTTP endpoint after one warm-up question.",
        "tables": [{"caption": "Per arm; ROUGE-L and identical answers against the exact arm's.",
                    "columns": ["engine", "questions/s", "over exact", "TTFT median s", "latency median s",
                                "identical answers", "ROUGE-L vs exact", "prompt tokens evaluated"], "rows": rows}],
        "plots": [{"title": f"Questions per second, the {args.stream} stream", "kind": "bar", "ylabel": "questions/s",
                   "x": ["questions/s"], "series": {name: [round(run["questions_per_s"], 4)] for name, run in runs.items()}}],
        "runs": {name: {k: v for k, v in run.items() if k != "results"} for name, run in runs.items()},
    }


if __name__ == "__main__":
    main()
