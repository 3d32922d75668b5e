"""New questions over popular documents: RAG written with plain libraries, and with patchkit, in one run.

    python benchmarks/rag_stream.py --count 64 --clients 8 --json rag-stream.json

The stream (`benchmarks/question_stream.py`): questions made from the pydoc corpus's modules, one per
module and per documented function, class and method, none asked twice, drawn so that modules are
popular by a Zipf law (`--zipf`, over a `--seed`ed ranking): the documents the questions retrieve
repeat while the questions do not. The skew realised in the retrieved documents is measured and
printed. Every system answers the same prefix of the stream (`--count` questions, or as many as it
answers in `--seconds`) with the same pipeline: the top `--topk` pydoc chunks by MiniLM and a FAISS
flat inner-product index, then SmolLM2-135M-Instruct (llama.cpp, greedy, `--max-tokens`) answering
over them with the same prompt. One after another, on the same cores:

- `plain`: the pipeline written straight on the libraries a user would pick without patchkit:
  sentence-transformers, FAISS and llama-cpp-python's `Llama` (`create_chat_completion`, which
  reuses the prompt prefix it evaluated last), one question at a time on every core;
- `plain-cache`: the same, with `Llama.set_cache(LlamaRAMCache(...))`, llama-cpp-python's own
  prompt cache (the KV state after each prompt, restored for a later prompt sharing its prefix);
  the faster of the two is the baseline every ratio is taken against;
- `eager`: patchkit's captured pipeline (`FaissRetriever`, `LlamaCppGenerator`) called as
  `pipeline(question=...)` in a loop: the same code as plain Python, in this process;
- `deployed`: the same pipeline under `patchkit.deploy()` on worker processes, the LLM as two
  1-thread replicas a core each lending an eighth to the retriever (`--replicas 1`: one replica of
  2 threads; `--plan auto`: `patchkit.plan()`), asked by `--clients` closed-loop clients;
- `deployed-no-doc-cache`: as `deployed`, with `LlamaCppGenerator(kv_cache_bytes=0)`: no document
  KV cache, only the engine's slots' prefixes;
- `deployed-reorder` (only when named in `--systems`): as `deployed`, with `reorder_docs=True`, the
  documents the cache holds put first (the answers may change: they are compared).

A deployed system whose option this version of `LlamaCppGenerator` lacks is reported as not available.

Before them, the llama.cpp engine's prompt and decode rates are measured on 1 and 2 threads. With the
stream's token counts they give the machine's bound: the most questions per second the cores could
answer evaluating every prompt token (no reuse), and evaluating only the prompt tokens no earlier
prompt of the stream shares as a prefix (perfect reuse of repeated documents). Each system's
throughput is reported against both, with its prompt tokens evaluated, and its answers compared with
the baseline's (greedy answers: identical unless evaluation order moves a near-tie). With both
`deployed` arms, it also prints the most any prefix cache could add to the one without the document
cache: its prompt tokens evaluated against those no earlier prompt shares (`benchmarks/prefix_replay.py`
replays the stream through the engines' own reuse rules for a tighter figure). `--kv-cache-bytes`
sets the document cache's budget of the arms that keep one.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import patchkit  # noqa: E402
from benchmarks.question_stream import Question, catalogue, doc_ids, draw, fit_zipf, popularity, unshared_tokens  # noqa: E402
from patchkit.components import FaissRetriever, LlamaCppGenerator  # noqa: E402
from patchkit.components.documents import Document, pydoc_corpus  # noqa: E402
from patchkit.components.embedder import default_model_path  # noqa: E402
from patchkit.components.generators.base import DEFAULT_SYSTEM_PROMPT, default_gguf_path  # noqa: E402
from patchkit.components.generators.llama.generator import MAX_CONCURRENCY  # noqa: E402
from patchkit.components.generators.llama.loading import open_llama  # noqa: E402
from patchkit.orchestrator.resources import SHARES_PER_CORE  # noqa: E402
from patchkit.scheduler.offline.plan import ComponentPlan, Plan  # noqa: E402

DEFAULT_SYSTEMS = ("plain", "plain-cache", "eager", "deployed", "deployed-no-doc-cache")
SYSTEMS = (*DEFAULT_SYSTEMS, "deployed-reorder")
# LlamaCppGenerator's arguments for each deployed system.
LLM_OPTIONS: dict[str, dict[str, Any]] = {"deployed": {}, "deployed-no-doc-cache": {"kv_cache_bytes": 0},
                                          "deployed-reorder": {"reorder_docs": True}}
WARMUP = "What is the Python standard library?"  # each system's first, untimed question: not in the stream
CALIBRATION = 2  # questions past the stream's prefix that `--plan auto` calibrates on
RAM_CACHE_BYTES = 2 << 30  # LlamaRAMCache's own default capacity
RATE_SAMPLES = 3  # stream prompts whose evaluation times the engine's prompt rate


# --- the pipeline written on plain libraries ------------------------------------------------------------
def plain_messages(question: str, docs: Sequence[Document]) -> list[dict[str, str]]:
    """The chat a user would write by hand: the documents numbered, then the question."""
    context = "\n".join(f"[{i}] {doc.title}: {doc.text}" for i, doc in enumerate(docs, 1))
    user = f"Documents:\n{context}\n\nAnswer the question using the documents.\n\nQuestion: {question}"
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": user}]


class PlainRetriever:
    """MiniLM through sentence-transformers over the corpus, in a FAISS flat inner-product index."""

    def __init__(self, docs: Sequence[Document], topk: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import faiss
        import numpy as np
        from sentence_transformers import SentenceTransformer

        self.np, self.docs, self.topk = np, list(docs), topk
        self.model = SentenceTransformer(str(default_model_path()), device="cpu", local_files_only=True)
        vectors = self.embed([f"{doc.title}: {doc.text}" for doc in self.docs])
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)

    def embed(self, texts: list[str]) -> Any:
        vectors = self.model.encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
        return self.np.ascontiguousarray(vectors, dtype=self.np.float32)

    def __call__(self, question: str) -> list[Document]:
        _, ids = self.index.search(self.embed([question]), self.topk)
        return [self.docs[i] for i in ids[0] if i >= 0]


class PlainGenerator:
    """llama-cpp-python's `Llama`, with its RAM prompt cache when `cache_bytes`; counts the prompt tokens
    it evaluates (its first `eval` of each completion: what its prefix reuse left) and their seconds."""

    def __init__(self, *, threads: int, n_ctx: int, max_tokens: int, cache_bytes: int) -> None:
        from llama_cpp import LlamaRAMCache

        # As the generator loads it: no weight repacking where the CPU reports AMX, which crashes llama.cpp there.
        self.llm = open_llama(str(default_gguf_path()), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              verbose=False)
        if cache_bytes:
            self.llm.set_cache(LlamaRAMCache(capacity_bytes=cache_bytes))
        self.max_tokens = max_tokens
        self.counters = {"prompt_tokens": 0.0, "prompt_tokens_evaluated": 0.0, "prompt_s": 0.0, "generated_tokens": 0.0}
        self._prompt_next = False
        evaluate = self.llm.eval

        def counted(tokens: Sequence[int]) -> None:
            began, first = time.perf_counter(), self._prompt_next
            self._prompt_next = False
            evaluate(tokens)
            if first:
                self.counters["prompt_tokens_evaluated"] += len(tokens)
                self.counters["prompt_s"] += time.perf_counter() - began

        self.llm.eval = counted  # type: ignore[method-assign]

    def __call__(self, messages: list[dict[str, str]]) -> str:
        self._prompt_next = True
        chat: Any = messages  # llama-cpp-python types each message as its own TypedDict
        reply: Any = self.llm.create_chat_completion(messages=chat, max_tokens=self.max_tokens, temperature=0.0, seed=0)
        self.counters["prompt_tokens"] += reply["usage"]["prompt_tokens"]
        self.counters["generated_tokens"] += reply["usage"]["completion_tokens"]
        return str(reply["choices"][0]["message"]["content"]).strip()


# --- patchkit's pipeline --------------------------------------------------------------------------------
def rag_pipeline(retriever: FaissRetriever, llm: LlamaCppGenerator) -> patchkit.Pipeline:
    """examples/oneshot.py's pipeline, answering with the ids of the documents it read."""
    question = WARMUP
    with patchkit.capture(run=False, output="result") as pipeline:
        docs = retriever.retrieve(question)
        answer = llm.generate(question, docs)
        result = {"answer": answer, "documents": doc_ids(docs)}  # noqa: F841 - the pipeline's output
    return pipeline


def llm_options(system: str, kv_cache_bytes: int | None = None) -> dict[str, Any] | None:
    """LlamaCppGenerator's arguments for a deployed system, with `kv_cache_bytes` (when given) for those
    that keep a document cache; None where this version lacks one of them."""
    options = dict(LLM_OPTIONS[system])
    if kv_cache_bytes is not None and "kv_cache_bytes" not in options:
        options["kv_cache_bytes"] = kv_cache_bytes
    known = inspect.signature(LlamaCppGenerator.__init__).parameters
    return options if all(name in known for name in options) else None


def components(args: argparse.Namespace, **options: Any) -> tuple[FaissRetriever, LlamaCppGenerator]:
    """The pipeline's retriever and LLM, built as `args` say; `options` go to the LLM."""
    retriever = FaissRetriever("pydoc", topk=args.topk)
    return retriever, LlamaCppGenerator(max_tokens=args.max_tokens, n_ctx=args.n_ctx, **options)


def manual_plan(pipeline: patchkit.Pipeline, replicas: int, cores: int) -> Plan:
    """The LLM as `replicas` engines splitting the cores, each lending an eighth of its last core; the
    retriever on one eighth (what `patchkit.plan()` chose for the real examples on 2 cores)."""
    threads = cores // replicas
    parts = {}
    for name, component in pipeline.components.items():
        if isinstance(component, LlamaCppGenerator):
            parts[name] = ComponentPlan("cpu", replicas, MAX_CONCURRENCY, units=threads * SHARES_PER_CORE - 1, threads=threads)
        else:
            parts[name] = ComponentPlan("cpu", 1, 64, units=1, threads=1)
    llm = next(n for n, c in pipeline.components.items() if isinstance(c, LlamaCppGenerator))
    return Plan(parts, throughput=0.0, bottleneck=llm, capacity={"cpu": cores})


def engine_counters(endpoint: patchkit.Endpoint, component: str) -> dict[str, float]:
    """The numeric `stats()` of `component`'s replicas, summed."""
    summed: dict[str, float] = {}
    for report in endpoint.stats().get("replica_reports", {}).values():
        if report.get("component") == component:
            for key, value in (report.get("component_stats") or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    summed[key] = summed.get(key, 0.0) + value
    return summed


# --- running a system on the stream ---------------------------------------------------------------------
class Feed:
    """The stream's questions handed out in order to any number of clients, until they run out or, with
    `seconds`, until that long after `start()`."""

    def __init__(self, questions: Sequence[Question], seconds: float | None) -> None:
        self.questions, self.seconds = list(questions), seconds
        self._next, self._lock, self.started = 0, threading.Lock(), 0.0

    def start(self) -> None:
        self.started = time.perf_counter()

    def take(self) -> tuple[int, Question] | None:
        with self._lock:
            late = self.seconds is not None and time.perf_counter() - self.started >= self.seconds
            if late or self._next >= len(self.questions):
                return None
            self._next += 1
            return self._next - 1, self.questions[self._next - 1]


@dataclass
class Run:
    """One system's answers to the stream's prefix, by position in the stream, and what it cost."""

    system: str
    outputs: dict[int, dict[str, Any]] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    seconds: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)
    note: str = ""

    @property
    def throughput(self) -> float:
        return len(self.outputs) / self.seconds if self.seconds else 0.0


def drive(run: Run, ask: Callable[[str], dict[str, Any]], feed: Feed, clients: int) -> None:
    """`clients` closed-loop clients asking `ask` the feed's questions; the run's seconds end at its last answer."""
    lock = threading.Lock()

    def client() -> None:
        while (item := feed.take()) is not None:
            index, question = item
            try:
                output = ask(question.text)
            except Exception as exc:  # one failed question is counted, not the end of the run
                with lock:
                    run.errors[index] = f"{type(exc).__name__}: {exc}"
                continue
            with lock:
                run.outputs[index] = output
                run.seconds = time.perf_counter() - feed.started

    feed.start()
    workers = [threading.Thread(target=client, name=f"client-{i}") for i in range(clients)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {key: value - before.get(key, 0.0) for key, value in after.items() if isinstance(value, (int, float))}


def run_plain(name: str, retrieve: PlainRetriever, args: argparse.Namespace, feed: Feed, cores: int) -> Run:
    generate = PlainGenerator(threads=cores, n_ctx=args.n_ctx, max_tokens=args.max_tokens,
                              cache_bytes=RAM_CACHE_BYTES if name == "plain-cache" else 0)

    def ask(question: str) -> dict[str, Any]:
        docs = retrieve(question)
        return {"answer": generate(plain_messages(question, docs)), "documents": [doc.id for doc in docs]}

    ask(WARMUP)
    run, before = Run(name), dict(generate.counters)
    drive(run, ask, feed, clients=1)
    run.counters = delta(generate.counters, before)
    return run


def run_eager(args: argparse.Namespace, feed: Feed) -> Run:
    retriever, llm = components(args)
    pipeline = rag_pipeline(retriever, llm)
    pipeline(question=WARMUP)
    run, before = Run("eager"), llm.stats()
    drive(run, lambda question: dict(pipeline(question=question)), feed, clients=1)
    run.counters = delta(llm.stats(), before)
    if llm.engine is not None:
        llm.engine.close()
    return run


def run_deployed(name: str, args: argparse.Namespace, feed: Feed, cores: int, calibration: Sequence[Question]) -> Run:
    options = llm_options(name, args.kv_cache_bytes)
    if options is None:
        return Run(name, note=f"not available: LlamaCppGenerator takes no {', '.join(LLM_OPTIONS[name])} here")
    retriever, llm = components(args, **options)
    pipeline = rag_pipeline(retriever, llm)
    llm_name = next(n for n, c in pipeline.components.items() if c is llm)
    if args.plan == "auto":
        plan = patchkit.plan(pipeline, resources={"cpu": cores}, calibration=[{"question": q.text} for q in calibration])
        note = f"planned: {plan.table().splitlines()[-1]}"
    else:
        plan = manual_plan(pipeline, args.replicas, cores)
        note = f"LLM {args.replicas} x {cores // args.replicas} thread(s)"
    print(plan, file=sys.stderr)
    with patchkit.deploy(pipeline, plan=plan, autoscale=False, request_timeout_s=900) as endpoint:
        endpoint.query(question=WARMUP)
        run, before = Run(name, note=note), engine_counters(endpoint, llm_name)
        drive(run, lambda question: dict(endpoint.query(question=question)), feed, clients=args.clients)
        run.counters = delta(engine_counters(endpoint, llm_name), before)
    return run


# --- the machine's bound --------------------------------------------------------------------------------
def engine_rates(threads: int, samples: Sequence[tuple[str, list[Document]]], concurrency: int) -> dict[str, float]:
    """The engine's prompt tokens/s (evaluating `samples`' prompts from scratch) and decode tokens/s for 1
    sequence and for `concurrency` at once, on `threads` threads (benchmarks/generator_engine.py's way)."""
    from benchmarks.generator_engine import decode_rates

    llm = LlamaCppGenerator(threads=threads, prefix_cache=False, n_ctx=2048)
    llm.setup()
    engine = llm.engine
    assert engine is not None
    llm.generate("Warm up.", max_tokens=8)
    before = engine.stats()
    for question, docs in samples:
        llm.generate(question, docs, max_tokens=1)
    spent = delta(engine.stats(), before)
    found = {
        "threads": float(threads),
        "prompt_tok_s": spent["prompt_tokens_evaluated"] / spent["prefill_s"],
        "decode_tok_s_1": decode_rates(llm, 1)["decode_tok_s"],
        "decode_tok_s_batched": decode_rates(llm, concurrency)["decode_tok_s"],
        "batched_sequences": float(concurrency),
    }
    engine.close()
    return found


def bound(rates: Sequence[dict[str, float]], prompt: float, unshared: float, generated: float, cores: int) -> dict[str, Any]:
    """Questions/s the cores could answer at the measured rates, for questions of `prompt` prompt tokens
    (`unshared` of them not shared with an earlier prompt) and `generated` tokens on average: per engine
    layout (cores // threads engines of `threads` threads, decoding batched), the best of them, and one
    question at a time on every core (what a sequential program could reach)."""
    layouts = []
    for r in rates:
        engines = cores // int(r["threads"])
        decode_s = generated / r["decode_tok_s_batched"]
        layouts.append({**r, "engines": engines, "no_reuse": engines / (prompt / r["prompt_tok_s"] + decode_s),
                        "perfect_reuse": engines / (unshared / r["prompt_tok_s"] + decode_s)})
    whole = max(rates, key=lambda r: r["threads"])
    one_at_a_time = generated / whole["decode_tok_s_1"]
    return {"layouts": layouts, "no_reuse": max(x["no_reuse"] for x in layouts),
            "perfect_reuse": max(x["perfect_reuse"] for x in layouts),
            "sequential": 1 / (prompt / whole["prompt_tok_s"] + one_at_a_time),
            "sequential_perfect_reuse": 1 / (unshared / whole["prompt_tok_s"] + one_at_a_time)}


def cache_ceiling(found: dict[str, Any], runs: dict[str, Run]) -> str:
    """What any prefix cache could add to `deployed-no-doc-cache`, beside what the document cache did: that
    arm's time at the engines' measured rates against the time with every prefix an earlier prompt shares
    reused (its decoding unchanged); empty unless that arm and `deployed` both answered."""
    without, with_cache = runs.get("deployed-no-doc-cache"), runs.get("deployed")
    if without is None or with_cache is None or not without.outputs or not with_cache.outputs:
        return ""
    threads = found["cores"] // found["settings"]["replicas"]
    layout = next(x for x in found["bound"]["layouts"] if int(x["threads"]) == threads)
    load, answered = found["workload"], len(without.outputs)
    decode_s = load["generated_tokens"] * answered / layout["decode_tok_s_batched"]
    evaluated = without.counters.get("prompt_tokens_evaluated", 0.0)
    ceiling = (evaluated / layout["prompt_tok_s"] + decode_s) / (
        load["unshared_prompt_tokens"] * answered / layout["prompt_tok_s"] + decode_s)
    return (f"the document cache: {with_cache.throughput / without.throughput:.2f}x deployed-no-doc-cache; the most "
            f"any prefix cache could add to that arm: {ceiling:.2f}x (its {evaluated:.0f} prompt tokens evaluated "
            f"against the {load['unshared_prompt_tokens'] * answered:.0f} no earlier prompt shares, decoding unchanged, "
            f"at the rates of {layout['engines']} x {threads} thread(s))")


# --- reporting ------------------------------------------------------------------------------------------
def markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join([*lines, *("| " + " | ".join(row) + " |" for row in rows)])


def baseline_of(runs: dict[str, Run]) -> Run | None:
    """The faster of the plain-library runs, the baseline of every ratio; else the first run that answered."""
    plain = [runs[name] for name in ("plain", "plain-cache") if name in runs and runs[name].outputs]
    return max(plain, key=lambda run: run.throughput, default=next((r for r in runs.values() if r.outputs), None))


def agreement(run: Run, reference: Run) -> str:
    common = sorted(set(run.outputs) & set(reference.outputs))
    answers = sum(run.outputs[i]["answer"] == reference.outputs[i]["answer"] for i in common)
    docs = sum(run.outputs[i]["documents"] == reference.outputs[i]["documents"] for i in common)
    return f"{answers}/{len(common)} ({docs} same documents)"


def prompt_rate(run: Run) -> str:
    """Prompt tokens per second of prompt evaluation, per engine: plain's timed `eval`, or the engines' prefill_s."""
    seconds = run.counters.get("prompt_s") or run.counters.get("prefill_s")
    return f"{run.counters.get('prompt_tokens_evaluated', 0.0) / seconds:.0f}" if seconds else "-"


def system_rows(runs: dict[str, Run], limits: dict[str, Any], prompt_total: dict[int, int]) -> list[list[str]]:
    base = baseline_of(runs)
    rows = []
    for name, run in runs.items():
        if base is None or not run.outputs:
            rows.append([name, run.note or "no answers", *["-"] * 6])
            continue
        total = sum(prompt_total[i] for i in run.outputs)
        evaluated = run.counters.get("prompt_tokens_evaluated", 0.0)
        restored = run.counters.get("kv_cache_tokens_saved", 0.0)
        rows.append([
            name, f"{len(run.outputs)} in {run.seconds:.1f} s" + (f", {len(run.errors)} failed" if run.errors else ""),
            f"{run.throughput:.3f}", f"{run.throughput / base.throughput:.2f}x",
            f"{evaluated:.0f} / {total} ({100 * evaluated / total:.0f}%)"
            + (f"; {restored:.0f} from the document cache" if restored else ""), prompt_rate(run), agreement(run, base),
            f"{100 * run.throughput / limits['no_reuse']:.0f}% / {100 * run.throughput / limits['perfect_reuse']:.0f}%",
        ])
    return rows


def bound_rows(limits: dict[str, Any]) -> list[list[str]]:
    return [[f"{x['engines']} x {x['threads']:.0f}", f"{x['prompt_tok_s']:.0f}", f"{x['decode_tok_s_1']:.0f}",
             f"{x['decode_tok_s_batched']:.0f} ({x['batched_sequences']:.0f} at once)", f"{x['no_reuse']:.3f}",
             f"{x['perfect_reuse']:.3f}"] for x in limits["layouts"]]


def report(found: dict[str, Any], runs: dict[str, Run], prompt_total: dict[int, int]) -> str:
    limits, load, stream = found["bound"], found["workload"], found["stream"]
    base = baseline_of(runs)
    return "\n".join([
        f"stream: {stream['questions']} questions, none repeated; modules: {stream['module_popularity']}",
        f"documents: {stream['document_popularity']}",
        f"the same number of questions drawn uniformly (Zipf s = 0): {stream['uniform_popularity']}",
        f"retrieval: {100 * stream['expected_module_hit']:.0f}% of questions retrieved a chunk of their own module",
        f"workload per question: {load['prompt_tokens']:.0f} prompt tokens, {load['unshared_prompt_tokens']:.0f} of them "
        f"not shared with an earlier prompt; {load['generated_tokens']:.1f} generated ({load['generated_from']})",
        "",
        markdown(["system", "answered", "questions/s", f"vs {base.system if base else '-'}", "prompt tokens evaluated / total",
                  "prompt tok/s per engine", f"identical answers to {base.system if base else '-'}",
                  "of bound (no reuse / perfect reuse)"], system_rows(runs, limits, prompt_total)),
        "",
        markdown(["engines x threads", "prompt tok/s", "decode tok/s, 1", "decode tok/s, batched", "bound q/s, no reuse",
                  "bound q/s, perfect reuse"], bound_rows(limits)),
        f"bound: {limits['no_reuse']:.3f} q/s with no reuse, {limits['perfect_reuse']:.3f} with perfect reuse; one question "
        f"at a time on every core (decoding 1 sequence): {limits['sequential']:.3f} and {limits['sequential_perfect_reuse']:.3f}",
        cache_ceiling(found, runs),
    ])


# --- the run --------------------------------------------------------------------------------------------
def describe_stream(questions: Sequence[Question], retrieved: Sequence[list[Document]], corpus: int) -> dict[str, Any]:
    modules = sorted(Counter(q.module for q in questions).values(), reverse=True)
    found = popularity([[doc.id for doc in docs] for docs in retrieved], corpus)
    hit = sum(any(doc.id.startswith(f"module:{q.module}#") for doc in docs) for q, docs in zip(questions, retrieved))
    return {
        "questions": len(questions),
        "module_popularity": f"{len(modules)} asked about, Zipf s = {fit_zipf(modules):.2f}, the top 3 drew "
                             f"{100 * sum(modules[:3]) / len(questions):.0f}% of the questions",
        "document_popularity": found.describe(),
        "popularity": asdict(found),
        "expected_module_hit": hit / len(questions),
        "asked": [asdict(q) for q in questions],
    }


def measure_stream(args: argparse.Namespace, docs: Sequence[Document], retrieve: PlainRetriever
                   ) -> tuple[list[Question], list[Question], list[list[Document]], dict[str, Any]]:
    """The stream's first `count` questions, the next few (to calibrate a plan on), their documents, and
    the skew they realised, beside that of as many questions drawn uniformly."""
    questions = catalogue({doc.title for doc in docs if doc.id.startswith("module:")}, seed=args.seed)
    stream = draw(questions, args.count + CALIBRATION, s=args.zipf, seed=args.seed)
    asked, calibration = stream[: args.count], stream[args.count :]
    retrieved = [retrieve(q.text) for q in asked]
    described = describe_stream(asked, retrieved, len(docs))
    uniform = [[doc.id for doc in retrieve(q.text)] for q in draw(questions, args.count, s=0.0, seed=args.seed)]
    described["uniform_popularity"] = popularity(uniform, len(docs)).describe()
    return asked, calibration, retrieved, described


def tokenized(args: argparse.Namespace, questions: Sequence[Question], retrieved: Sequence[list[Document]]
              ) -> list[tuple[list[int], list[int]]]:
    """Each question's prompt as the engine tokenizes it, with where its pieces end (the system prompt, then
    each document: what the document cache keeps); checks first that plain code sends the same prompt."""
    tokenizer = LlamaCppGenerator(n_ctx=args.n_ctx, threads=1)
    tokenizer.setup()
    if tokenizer.messages(questions[0].text, retrieved[0]) != plain_messages(questions[0].text, retrieved[0]):
        raise SystemExit("the plain pipeline's prompt differs from LlamaCppGenerator's: their answers cannot be compared")
    prompts = [tokenizer.prompt(tokenizer.messages(q.text, d), d) for q, d in zip(questions, retrieved)]
    assert tokenizer.engine is not None
    tokenizer.engine.close()
    return prompts


def run_system(name: str, args: argparse.Namespace, feed: Feed, retrieve: PlainRetriever, cores: int,
               calibration: Sequence[Question]) -> Run:
    if name.startswith("plain"):
        return run_plain(name, retrieve, args, feed, cores)
    if name == "eager":
        return run_eager(args, feed)
    return run_deployed(name, args, feed, cores, calibration)


def workload(runs: dict[str, Run], prompts: Sequence[Sequence[int]], max_tokens: int) -> dict[str, Any]:
    """Mean prompt tokens, unshared prompt tokens (in stream order) and generated tokens over the questions answered."""
    answered = sorted(set().union(*(r.outputs for r in runs.values()))) or list(range(len(prompts)))
    unshared = unshared_tokens([prompts[i] for i in answered])
    source = next((r for r in runs.values() if r.counters.get("generated_tokens") and r.outputs), None)
    return {"questions": len(answered), "prompt_tokens": sum(len(prompts[i]) for i in answered) / len(answered),
            "unshared_prompt_tokens": sum(unshared) / len(answered),
            "generated_tokens": source.counters["generated_tokens"] / len(source.outputs) if source else float(max_tokens),
            "generated_from": f"as {source.system} generated" if source else "max_tokens"}


def save(found: dict[str, Any], path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(found, indent=1, default=str))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=64, help="questions of the stream each system answers")
    parser.add_argument("--seconds", type=float, help="instead: answer for this long from the stream (count bounds it)")
    parser.add_argument("--clients", type=int, default=8, help="closed-loop clients of the deployed systems")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, from {', '.join(SYSTEMS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zipf", type=float, default=1.0, help="the Zipf exponent of module popularity")
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, help="the document cache's budget per LLM replica (default: "
                        "LlamaCppGenerator's)")
    parser.add_argument("--replicas", type=int, choices=(1, 2), default=2, help="LLM replicas of the deployed systems")
    parser.add_argument("--plan", choices=("manual", "auto"), default="manual", help="auto: patchkit.plan() on 2 questions")
    parser.add_argument("--json", help="write the raw results here")
    args = parser.parse_args()
    # The deployment's front-end unpickles the pipeline, which calls benchmarks.question_stream.doc_ids.
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if unknown := [s for s in systems if s not in SYSTEMS]:
        raise SystemExit(f"--systems: unknown {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    cores = len(os.sched_getaffinity(0))
    started = time.perf_counter()
    docs = pydoc_corpus()
    retrieve = PlainRetriever(docs, args.topk)
    questions, calibration, retrieved, described = measure_stream(args, docs, retrieve)
    found: dict[str, Any] = {"settings": vars(args), "cores": cores, "stream": described}
    print(described["module_popularity"], described["document_popularity"], sep="\n", file=sys.stderr)
    prompts = [tokens for tokens, _ in tokenized(args, questions, retrieved)]
    samples = [(q.text, d) for q, d in zip(questions, retrieved)][:RATE_SAMPLES]
    rates = [engine_rates(t, samples, max(1, args.clients * t // cores)) for t in sorted({1, cores})]
    print("engine rates:", json.dumps(rates), file=sys.stderr)
    runs: dict[str, Run] = {}
    for name in systems:
        runs[name] = run_system(name, args, Feed(questions, args.seconds), retrieve, cores, calibration)
        print(f"{name}: {len(runs[name].outputs)} answers in {runs[name].seconds:.1f} s {runs[name].note}", file=sys.stderr)
        found["runs"] = {n: asdict(r) for n, r in runs.items()}
        save(found, args.json)  # a run cut short keeps what it measured
    found["workload"] = load = workload(runs, prompts, args.max_tokens)
    found["bound"] = bound(rates, load["prompt_tokens"], load["unshared_prompt_tokens"], load["generated_tokens"], cores)
    found["wall_s"] = time.perf_counter() - started
    save(found, args.json)
    print(report(found, runs, {i: len(p) for i, p in enumerate(prompts)}))
    print(f"\nwall time {found['wall_s']:.0f} s on {cores} cores")


if __name__ == "__main__":
    main()
