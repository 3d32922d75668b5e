"""Capacity over HTTP: patchkit against the FastAPI server a competent user writes, on real models.

    python benchmarks/capacity.py --arms fastapi,patchkit --json capacity-raw.json
    python benchmarks/capacity.py --quick                   # a smoke test: a few questions, one rate

The job is `benchmarks/rag_stream.py`'s: the top `--topk` pydoc chunks by MiniLM and a FAISS flat
index, then SmolLM2-135M-Instruct (llama.cpp, greedy, `--max-tokens`) answering over them, on the
same stream of new questions over Zipf-popular modules (`benchmarks/question_stream.py`: documents
recur, questions do not). Each arm is a fresh server process, asked over HTTP by aiohttp clients:

- `fastapi`: `benchmarks/baselines/fastapi_rag.py`, FastAPI + uvicorn, sync handlers on its thread
  pool, sentence-transformers, FAISS, one 1-thread `Llama` per core from a `queue.Queue`;
- `patchkit`: the same pipeline captured with `FaissRetriever` and `LlamaCppGenerator`, deployed with
  `plan="auto"` (calibrated on questions past the stream's) on the default backend;
- `patchkit-unplanned`: the same, `patchkit.deploy(pipeline)` with no plan: the machine's defaults.

Every arm answers, in this order and on the same questions: `--ttft` streamed questions one at a time
(time to first token and latency unloaded); `--closed` questions from 16 closed-loop clients
(`--clients`: throughput at saturation); then, for each of `--rates`, `--per-rate` questions arriving
as a Poisson process at that rate (open loop: p50/p99 latency from each question's arrival). The
highest rate whose p99 stays within `--slo-s` with no error is the rate the arm sustains. Resident
and unique memory (psutil's rss and uss) of the server's process tree are read after the closed loop.

`--arms bound` measures the engine's prompt and decode rates at 1 and 2 threads on the stream's
prompts (as rag_stream does) and, with the stream's mean prompt and answer tokens, the machine's bound.
Results accumulate in `--json` (arms run in separate invocations keep each other's); `--result`
writes benchmarks/results/capacity.json from it. The machine's load average is recorded beside each arm.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.blend_quality import rouge_l  # noqa: E402
from benchmarks.question_stream import catalogue, draw  # noqa: E402

ARMS = ("fastapi", "patchkit", "patchkit-unplanned", "bound")
WARMUP = "What is the Python standard library?"  # each server's first, untimed question: not in the stream
CALIBRATION = 4  # questions past the stream that plan="auto" calibrates on
READY_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 600.0


# --- the stream -----------------------------------------------------------------------------------------
def stream(args: argparse.Namespace) -> tuple[dict[str, list[str]], list[str]]:
    """The questions of each phase (disjoint, in stream order), and those past them to calibrate a plan on."""
    from patchkit.components.documents import pydoc_corpus

    modules = {doc.title for doc in pydoc_corpus() if doc.id.startswith("module:")}
    sizes = {"ttft": args.ttft, "closed": args.closed, **{f"rate {r:g}": args.per_rate for r in args.rates}}
    drawn = [q.text for q in draw(catalogue(modules, seed=args.seed), sum(sizes.values()) + CALIBRATION,
                                  s=args.zipf, seed=args.seed)]
    phases, at = {}, 0
    for name, size in sizes.items():
        phases[name], at = drawn[at : at + size], at + size
    return phases, drawn[at:]


# --- the servers ----------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def serve_patchkit(args: argparse.Namespace) -> None:
    """This process as the `patchkit` arm's server: plan (or not), deploy, print READY, serve until SIGTERM."""
    import threading

    import patchkit
    from benchmarks.rag_stream import rag_pipeline
    from patchkit.components import FaissRetriever, LlamaCppGenerator

    retriever = FaissRetriever("pydoc", topk=args.topk)
    llm = LlamaCppGenerator(max_tokens=args.max_tokens, n_ctx=args.n_ctx)
    pipeline = rag_pipeline(retriever, llm)
    options: dict[str, Any] = {"port": args.port, "request_timeout_s": REQUEST_TIMEOUT_S}
    if args.serve == "patchkit":
        _, calibration = stream(args)
        options.update(plan="auto", calibration=[{"question": q} for q in calibration])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with patchkit.deploy(pipeline, **options) as endpoint:
        print(f"READY {endpoint.url}", flush=True)
        stop.wait()


def start(arm: str, args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    """The arm's server as a fresh process; returns it and its URL once it answers."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "HF_HUB_OFFLINE": "1"}
    common = ["--topk", str(args.topk), "--max-tokens", str(args.max_tokens), "--n-ctx", str(args.n_ctx)]
    if arm == "fastapi":
        command = [sys.executable, "-m", "benchmarks.baselines.fastapi_rag", "--port", str(free_port()), *common,
                   "--ram-cache", str(args.ram_cache)]
    else:
        command = [sys.executable, str(Path(__file__).resolve()), "--serve", arm, "--port", str(free_port()), *common,
                   "--seed", str(args.seed), "--zipf", str(args.zipf), "--ttft", str(args.ttft), "--closed",
                   str(args.closed), "--per-rate", str(args.per_rate), "--rates", ",".join(map(str, args.rates))]
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert server.stdout is not None
    began = time.monotonic()
    for line in server.stdout:
        if line.startswith("READY "):
            url = line.split()[1]
            break
        if time.monotonic() - began > READY_TIMEOUT_S:
            break
    else:
        raise SystemExit(f"{arm}: the server exited with {server.wait()} before it was ready")
    asyncio.run(wait_ready(url))
    print(f"{arm}: ready at {url} after {time.monotonic() - began:.0f} s", file=sys.stderr)
    return server, url


async def wait_ready(url: str) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for _ in range(int(READY_TIMEOUT_S * 2)):
            try:
                async with session.get(url + "/healthz") as reply:
                    if reply.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit(f"{url} never answered /healthz")


async def get_json(url: str) -> Any:
    async with session() as s, s.get(url) as reply:
        return await reply.json()


def stop(server: subprocess.Popen[str]) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def memory(pid: int) -> dict[str, Any]:
    """Resident and unique MiB of `pid` and every process under it, each and summed."""
    import psutil

    root = psutil.Process(pid)
    rows = []
    for process in [root, *root.children(recursive=True)]:
        try:
            info = process.memory_full_info()
            name = " ".join(os.path.relpath(a) if os.path.isabs(a) else a for a in process.cmdline()[1:4])[:80]
        except psutil.Error:
            continue
        rows.append({"pid": process.pid, "name": name, "rss_mib": info.rss / 2**20, "uss_mib": info.uss / 2**20})
    return {"processes": rows, "rss_mib": sum(r["rss_mib"] for r in rows), "uss_mib": sum(r["uss_mib"] for r in rows)}


# --- the load -------------------------------------------------------------------------------------------
async def ask(session: Any, url: str, question: str, stream: bool = False) -> dict[str, Any]:
    """One question; its latency, time to first token (streamed), answer and documents, or its error."""
    began = time.perf_counter()
    body = {"inputs": {"question": question}, "stream": stream}
    try:
        async with session.post(url + "/v1/query", json=body) as reply:
            if reply.status != 200:
                return {"error": f"HTTP {reply.status}: {(await reply.text())[:200]}"}
            if not stream:
                output = (await reply.json())["output"]
                return {"latency_s": time.perf_counter() - began, **output}
            first, output = None, None
            async for raw in reply.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                event = json.loads(line[5:])
                if "delta" in event and first is None:
                    first = time.perf_counter() - began
                if "output" in event:
                    output = event["output"]
            if output is None:
                return {"error": "the stream ended with no output"}
            return {"latency_s": time.perf_counter() - began, "ttft_s": first, **output}
    except (TimeoutError, OSError) as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def session() -> Any:
    import aiohttp

    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                                 connector=aiohttp.TCPConnector(limit=0))


async def one_by_one(url: str, questions: Sequence[str], stream: bool) -> list[dict[str, Any]]:
    async with session() as s:
        return [await ask(s, url, q, stream) for q in questions]


async def closed_loop(url: str, questions: Sequence[str], clients: int) -> tuple[list[dict[str, Any]], float]:
    """`clients` clients each asking its next question as soon as it has an answer; the answers and seconds."""
    answers: list[dict[str, Any]] = [{} for _ in questions]
    left = iter(range(len(questions)))

    async def client(s: Any) -> None:
        for i in left:
            answers[i] = await ask(s, url, questions[i])

    async with session() as s:
        began = time.perf_counter()
        await asyncio.gather(*(client(s) for _ in range(clients)))
        return answers, time.perf_counter() - began


async def open_loop(url: str, questions: Sequence[str], rate: float, seed: int) -> tuple[list[dict[str, Any]], float]:
    """The questions arriving as a Poisson process of `rate` per second; latency counts from each arrival."""
    rng = random.Random(seed)
    async with session() as s:
        began = time.perf_counter()
        tasks, at = [], 0.0
        for question in questions:
            await asyncio.sleep(max(0.0, began + at - time.perf_counter()))
            tasks.append(asyncio.create_task(ask(s, url, question)))
            at += rng.expovariate(rate)
        answers = list(await asyncio.gather(*tasks))
        return answers, time.perf_counter() - began


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (nearest rank, as latency reports use)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(-(-q * len(ordered) // 100)) - 1))]


def latencies(answers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    done = [a["latency_s"] for a in answers if "latency_s" in a]
    if not done:
        return {"answered": 0, "errors": len(answers)}
    return {"answered": len(done), "errors": len(answers) - len(done), "p50_s": percentile(done, 50),
            "p99_s": percentile(done, 99), "mean_s": statistics.fmean(done)}


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_arm(arm: str, args: argparse.Namespace, phases: dict[str, list[str]]) -> dict[str, Any]:
    server, url = start(arm, args)
    found: dict[str, Any] = {"arm": arm, "load_before": load_average(), "phases": {}}
    try:
        asyncio.run(one_by_one(url, [WARMUP], stream=False))
        asyncio.run(one_by_one(url, [WARMUP], stream=True))
        found["ready_memory"] = memory(server.pid)
        if arm != "fastapi":
            found["plan"] = asyncio.run(get_json(url + "/v1/plan"))
        answers = asyncio.run(one_by_one(url, phases["ttft"], stream=True))
        ttft = [a["ttft_s"] for a in answers if a.get("ttft_s") is not None]
        found["phases"]["ttft"] = {**latencies(answers), "answers": answers,
                                   "ttft_p50_s": percentile(ttft, 50) if ttft else None,
                                   "ttft_max_s": max(ttft) if ttft else None}
        answers, seconds = asyncio.run(closed_loop(url, phases["closed"], args.clients))
        found["phases"]["closed"] = {**latencies(answers), "answers": answers, "seconds": seconds,
                                     "throughput": sum("latency_s" in a for a in answers) / seconds,
                                     "load": load_average()}
        found["memory"] = memory(server.pid)
        print(f"{arm}: closed loop {found['phases']['closed']['throughput']:.3f} q/s; memory "
              f"{found['memory']['rss_mib']:.0f} MiB rss, {found['memory']['uss_mib']:.0f} uss", file=sys.stderr)
        for rate in args.rates:
            name = f"rate {rate:g}"
            answers, seconds = asyncio.run(open_loop(url, phases[name], rate, args.seed))
            found["phases"][name] = {**latencies(answers), "answers": answers, "rate": rate, "seconds": seconds,
                                     "load": load_average()}
            summary = found["phases"][name]
            print(f"{arm}: {name}: p50 {summary.get('p50_s', 0):.1f} s, p99 {summary.get('p99_s', 0):.1f} s, "
                  f"{summary['errors']} errors", file=sys.stderr)
            if summary.get("p99_s", float("inf")) > 3 * args.slo_s:
                break  # far past the SLO: higher rates only queue longer
    finally:
        stop(server)
    found["load_after"] = load_average()
    return found


# --- the machine's bound --------------------------------------------------------------------------------
def measure_bound(args: argparse.Namespace, found: dict[str, Any]) -> dict[str, Any]:
    """Engine rates at 1 and all threads on the stream's prompts, and the stream's mean tokens per question."""
    from benchmarks.rag_stream import engine_rates
    from patchkit.components import LlamaCppGenerator
    from patchkit.components.documents import pydoc_corpus
    from patchkit.components.generators.base import default_gguf_path
    from patchkit.components.generators.llama.loading import open_llama

    arm = next(a for a in ("fastapi", "patchkit", "patchkit-unplanned") if a in found.get("arms", {}))
    closed = found["arms"][arm]["phases"]["closed"]["answers"]
    corpus = {doc.id: doc for doc in pydoc_corpus()}
    questions = found["phases"]["closed"]
    asked = [(q, [corpus[i] for i in a["documents"]]) for q, a in zip(questions, closed) if "documents" in a]
    tokenizer = LlamaCppGenerator(n_ctx=args.n_ctx, threads=1)
    tokenizer.setup()
    prompt = statistics.fmean(len(tokenizer.tokens(tokenizer.messages(q, d))) for q, d in asked)
    if tokenizer.engine is not None:
        tokenizer.engine.close()
    vocab = open_llama(str(default_gguf_path()), vocab_only=True, verbose=False)
    generated = statistics.fmean(len(vocab.tokenize(a["answer"].encode(), add_bos=False)) + 1  # + end of turn
                                 for a in closed if "answer" in a)
    cores = len(os.sched_getaffinity(0))
    if args.bound_rates:  # rates measured before (rag_stream's result file), with this stream's tokens
        rates, source = rates_from(Path(args.bound_rates)), f"rates from {args.bound_rates}"
    else:
        rates = [engine_rates(t, asked[:3], max(1, args.clients * t // cores)) for t in sorted({1, cores})]
        source = "rates measured in this run"
    return {"prompt_tokens": prompt, "generated_tokens": generated, "rates": rates, "cores": cores,
            "load": load_average(), "source": source}


def rates_from(path: Path) -> list[dict[str, float]]:
    """The engine rates of a rag_stream result file's bound table ("2 x 1", prompt, decode 1, "98 (4 at once)")."""
    table = next(t for t in json.loads(path.read_text())["tables"] if t["columns"][0] == "engines x threads")
    return [{"threads": float(row[0].split(" x ")[1]), "prompt_tok_s": float(row[1]), "decode_tok_s_1": float(row[2]),
             "decode_tok_s_batched": float(row[3].split()[0])} for row in table["rows"]]


# --- reporting ------------------------------------------------------------------------------------------
def compare(arm: dict[str, Any], reference: dict[str, Any]) -> dict[str, float]:
    """Identical answers and mean ROUGE-L of `arm` against `reference`, over every question both answered."""
    pairs = [(a["answer"], b["answer"]) for phase in arm["phases"] if phase in reference["phases"]
             for a, b in zip(arm["phases"][phase]["answers"], reference["phases"][phase]["answers"])
             if "answer" in a and "answer" in b]
    if not pairs:
        return {"pairs": 0, "identical": 0.0, "rouge_l": 0.0}
    return {"pairs": len(pairs), "identical": sum(a == b for a, b in pairs) / len(pairs),
            "rouge_l": statistics.fmean(rouge_l(a, b) for a, b in pairs)}


def sustained(arm: dict[str, Any], slo_s: float) -> float:
    """The highest rate whose p99 is within the SLO with every question answered (0: none)."""
    ok = [p["rate"] for p in arm["phases"].values() if "rate" in p and not p["errors"] and p.get("p99_s", 1e9) <= slo_s]
    return max(ok, default=0.0)


def bound_of(bound: dict[str, Any]) -> list[dict[str, float]]:
    """Questions/s per engine layout at the measured rates: no reuse, decode batched and one at a time."""
    layouts = []
    for r in bound["rates"]:
        engines = bound["cores"] // int(r["threads"])
        prompt_s = bound["prompt_tokens"] / r["prompt_tok_s"]
        layouts.append({"engines": engines, "threads": int(r["threads"]), "prompt_tok_s": r["prompt_tok_s"],
                        "decode_tok_s_1": r["decode_tok_s_1"], "decode_tok_s_batched": r["decode_tok_s_batched"],
                        "one_at_a_time": engines / (prompt_s + bound["generated_tokens"] / r["decode_tok_s_1"]),
                        "batched": engines / (prompt_s + bound["generated_tokens"] / r["decode_tok_s_batched"])})
    return layouts


def report(found: dict[str, Any], slo_s: float) -> str:
    arms = found.get("arms", {})
    lines = [f"| arm | closed loop q/s (16 clients) | sustained q/s (p99 <= {slo_s:g} s) | TTFT p50 | rss MiB | uss MiB | load |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, arm in arms.items():
        closed, ttft, mem = arm["phases"]["closed"], arm["phases"]["ttft"], arm["memory"]
        lines.append(f"| {name} | {closed['throughput']:.3f} | {sustained(arm, slo_s):g} | {ttft['ttft_p50_s'] or 0:.2f} s "
                     f"| {mem['rss_mib']:.0f} | {mem['uss_mib']:.0f} | {arm['load_before'][0]:.1f}-{arm['load_after'][0]:.1f} |")
    lines += ["", "| arm | rate | p50 s | p99 s | errors |", "| --- | --- | --- | --- | --- |"]
    for name, arm in arms.items():
        for phase in arm["phases"].values():
            if "rate" in phase:
                lines.append(f"| {name} | {phase['rate']:g} | {phase.get('p50_s', 0):.1f} | {phase.get('p99_s', 0):.1f} "
                             f"| {phase['errors']} |")
    if "fastapi" in arms:
        for name in arms:
            if name != "fastapi":
                c = compare(arms[name], arms["fastapi"])
                lines.append(f"{name} vs fastapi: {100 * c['identical']:.0f}% identical answers, ROUGE-L "
                             f"{c['rouge_l']:.3f} over {c['pairs']}")
    if "bound" in found:
        for x in bound_of(found["bound"]):
            lines.append(f"bound {x['engines']} x {x['threads']}: prompt {x['prompt_tok_s']:.0f} tok/s, decode "
                         f"{x['decode_tok_s_1']:.0f} (1) / {x['decode_tok_s_batched']:.0f} (batched) tok/s -> "
                         f"{x['one_at_a_time']:.3f} q/s one at a time, {x['batched']:.3f} batched")
    return "\n".join(lines)


ARM_NAMES = {"fastapi": "FastAPI server (2 engines)", "patchkit": "patchkit, plan=\"auto\"",
             "patchkit-unplanned": "patchkit, no plan"}


def result_file(found: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """benchmarks/results/capacity.json: what the site draws, from the raw results."""
    arms, slo_s = found["arms"], found["settings"]["slo_s"]
    names = [ARM_NAMES.get(a, a) for a in arms]
    rows = []
    for arm_name, arm in arms.items():
        closed, ttft, mem = arm["phases"]["closed"], arm["phases"]["ttft"], arm["memory"]
        base = arms.get("fastapi", arm)["phases"]["closed"]["throughput"]
        rows.append([ARM_NAMES.get(arm_name, arm_name), f"{closed['throughput']:.3f}", f"{closed['throughput'] / base:.2f}x",
                     f"{closed['p50_s']:.1f} / {closed['p99_s']:.1f}", f"{sustained(arm, slo_s):g}",
                     f"{ttft['ttft_p50_s']:.2f}" if ttft.get("ttft_p50_s") is not None else "-",
                     f"{mem['rss_mib']:,.0f} / {mem['uss_mib']:,.0f} ({len(mem['processes'])})",
                     f"{arm['load_before'][0]:.1f}-{arm['load_after'][0]:.1f}"])
    rates = sorted({p["rate"] for arm in arms.values() for p in arm["phases"].values() if "rate" in p})
    def at(arm: dict[str, Any], rate: float, key: str) -> str:
        phase = arm["phases"].get(f"rate {rate:g}")
        if phase is None or key not in phase:
            return "-"
        return f"{phase[key]:.1f}" + (f" ({phase['errors']} failed)" if phase["errors"] else "")
    tables = [
        {"caption": f"Closed loop ({found['settings']['clients']} clients, {len(found['phases']['closed'])} questions) and "
                    f"open loop (Poisson): the highest rate with p99 <= {slo_s:g} s. Memory over each server's process "
                    "tree after the closed loop. Load: the 1-minute load average before and after the arm (2 cores, "
                    "its own processes and any other work).",
         "columns": ["server", "closed-loop q/s", "vs FastAPI", "closed-loop p50 / p99 s", f"sustained q/s (p99 <= {slo_s:g} s)",
                     "TTFT p50 s (streamed, unloaded)", "rss / uss MiB (processes)", "load"], "rows": rows},
        {"caption": "Open loop: latency from each question's arrival, p50 / p99 seconds, by arrival rate.",
         "columns": ["questions/s", *[f"{n} p50 / p99" for n in names]],
         "rows": [[f"{r:g}", *[f"{at(a, r, 'p50_s')} / {at(a, r, 'p99_s')}" for a in arms.values()]] for r in rates]},
        {"caption": "Memory by process (MiB, rss / uss) after the closed loop.",
         "columns": ["server", "process", "rss / uss MiB"],
         "rows": [[ARM_NAMES.get(n, n), p["name"] or str(p["pid"]), f"{p['rss_mib']:,.0f} / {p['uss_mib']:,.0f}"]
                  for n, a in arms.items() for p in a["memory"]["processes"]]},
    ]
    if "fastapi" in arms:
        tables.append({"caption": "Answers against the FastAPI server's on the same questions (greedy decoding).",
                       "columns": ["server", "questions", "identical", "ROUGE-L"],
                       "rows": [[ARM_NAMES.get(n, n), str(c["pairs"]), f"{100 * c['identical']:.0f}%", f"{c['rouge_l']:.3f}"]
                                for n in arms if n != "fastapi" for c in [compare(arms[n], arms["fastapi"])]]})
    if "bound" in found:
        b = found["bound"]
        tables.append({"caption": f"The machine's bound ({b['source']}): {b['prompt_tokens']:.0f} prompt and "
                                  f"{b['generated_tokens']:.0f} answer tokens a question, no prompt reuse.",
                       "columns": ["engines x threads", "prompt tok/s", "decode tok/s, 1 / batched", "q/s one at a time",
                                   "q/s decode batched"],
                       "rows": [[f"{x['engines']} x {x['threads']}", f"{x['prompt_tok_s']:.0f}",
                                 f"{x['decode_tok_s_1']:.0f} / {x['decode_tok_s_batched']:.0f}", f"{x['one_at_a_time']:.3f}",
                                 f"{x['batched']:.3f}"] for x in bound_of(b)]})
    plots = [{"title": f"Questions per second, {found['settings']['clients']} closed-loop clients", "kind": "bar",
              "ylabel": "questions/s", "x": names, "series": {"questions/s": [
                  round(a["phases"]["closed"]["throughput"], 3) for a in arms.values()]}}]
    common = [r for r in rates if all("p99_s" in a["phases"].get(f"rate {r:g}", {}) for a in arms.values())]
    if common:
        plots.append({"title": "p99 latency under Poisson arrivals", "kind": "line", "xlabel": "questions/s arriving",
                      "ylabel": "p99 latency (s)", "x": common, "series": {
                          n: [round(a["phases"][f"rate {r:g}"]["p99_s"], 2) for r in common]
                          for n, a in zip(names, arms.values())}})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    settings = found["settings"]
    return {
        "title": "Capacity over HTTP against a hand-written FastAPI server",
        "components": "real models",
        "machine": f"{found['cores']} cores (load averages in the table: above 1.5 on 2 cores, other work ran beside it)",
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": commit,
        "command": f"python benchmarks/capacity.py --arms {','.join(arms)} --closed {settings['closed']} --ttft "
                   f"{settings['ttft']} --rates {','.join(f'{r:g}' for r in settings['rates'])} --per-rate "
                   f"{settings['per_rate']} --slo-s {slo_s:g}",
        "setup": "New questions over Zipf-popular pydoc modules (documents recur, questions do not), the same for both "
                 "servers, over HTTP from aiohttp clients. Top 3 chunks by MiniLM and FAISS flat, then SmolLM2-135M "
                 f"Q4 (llama.cpp, greedy, {settings['max_tokens']} tokens). FastAPI: uvicorn, sync handlers, one 1-thread "
                 "Llama per core from a queue. patchkit: FaissRetriever + LlamaCppGenerator, deploy(plan=\"auto\") on "
                 "the local backend. Each server a fresh process.",
        "tables": tables,
        "plots": plots,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default="fastapi,patchkit", help=f"comma-separated, from {', '.join(ARMS)}")
    parser.add_argument("--quick", action="store_true", help="a smoke test: 2 + 4 questions, one rate of 2")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--ttft", type=int, default=3, help="streamed questions, one at a time")
    parser.add_argument("--closed", type=int, default=32, help="questions of the closed loop")
    parser.add_argument("--rates", default="0.2,0.3,0.4,0.5", help="open-loop arrivals per second, comma-separated")
    parser.add_argument("--per-rate", type=int, default=12, help="questions at each rate")
    parser.add_argument("--slo-s", type=float, default=15.0, help="the p99 latency a sustained rate keeps within")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--ram-cache", type=int, default=0, help="the FastAPI server's LlamaRAMCache bytes per engine")
    parser.add_argument("--bound-rates", help="with --arms bound: take the engine's rates from this rag_stream result "
                        "file instead of measuring them")
    parser.add_argument("--result", help="write the site's result file here from --json, and stop")
    parser.add_argument("--json", default="capacity-raw.json", help="raw results, kept across invocations")
    parser.add_argument("--serve", choices=("patchkit", "patchkit-unplanned"), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.rates = [float(r) for r in str(args.rates).split(",") if r]
    if args.serve:
        serve_patchkit(args)
        return
    if args.result:
        Path(args.result).write_text(json.dumps(result_file(json.loads(Path(args.json).read_text()), args), indent=1) + "\n")
        return
    if args.quick:
        args.ttft, args.closed, args.per_rate, args.rates = 1, 4, 2, [0.5]
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := set(arms) - set(ARMS):
        raise SystemExit(f"--arms: unknown {', '.join(sorted(unknown))}; known: {', '.join(ARMS)}")
    path = Path(args.json)
    found: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    phases, _ = stream(args)
    if found.get("phases") not in (None, phases):
        raise SystemExit(f"{path} holds another stream's results: pass another --json or the same settings")
    found.update(phases=phases, settings={k: v for k, v in vars(args).items() if k not in ("serve", "port")},
                 cores=len(os.sched_getaffinity(0)))
    found.setdefault("arms", {})
    for arm in arms:
        if arm == "bound":
            found["bound"] = measure_bound(args, found)
        else:
            found["arms"][arm] = run_arm(arm, args, phases)
        path.write_text(json.dumps(found, indent=1, default=str))
    print(report(found, args.slo_s))


if __name__ == "__main__":
    main()
