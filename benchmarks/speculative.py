"""Speculative retrieval: latency per request of the iterative example with and without speculation.

    python benchmarks/speculative.py --synthetic 8000000 --questions 6 --json speculative.json

Retriever: exact dense retrieval (FAISS flat, inner product) over the pydoc corpus's real MiniLM
vectors plus `--synthetic` random unit vectors (seeded normal draws, L2-normalised) added to the
same index as distractor documents with empty text. Random directions in 384 dimensions sit near
cosine 0 from every question, so the top hits stay the real pydoc chunks while each search costs
what a corpus of that size costs: one retrieval at least as long as one generation stride.
Generator: SmolLM2-135M-Instruct through llama.cpp, temperature 0. Pipeline: `examples/speculative.py`
(twelve rounds of 8 tokens, a retrieval after each), run eagerly in this process, once per question
with the plain retriever and once per speculative configuration, in alternating order, after one
warm-up request per configuration; the outputs must be identical. The plain runs time each
generation step and each retrieval: the regime needs a retrieval at least as long as a step.
FAISS searches on `--faiss-threads` (default: every core, FAISS's own default) and sends batches of
`--blas-from` queries or more through BLAS (one pass over the vectors per block of queries, where its
per-query scan makes one pass per query); llama.cpp runs on `--llm-threads`.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from patchkit.components import FaissRetriever, LlamaCppGenerator, SpeculativeRetriever
from patchkit.components.documents import Document

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = (
    "Which statement do I use to leave a loop early?",
    "How do I make a class usable in a with statement?",
    "How do I catch an exception and handle the error?",
    "How does a generator function yield values?",
    "How do I open a file and read its lines?",
    "What does the global statement do?",
)
WARM_UP = "How do I define a function with default arguments?"
CONFIGS = {
    "speculative, auto stride, async": {"stride": "auto", "async_verify": True},
    "speculative, auto stride, sync": {"stride": "auto", "async_verify": False},
    "speculative, auto stride, sync, gamma_max 0.9": {"stride": "auto", "async_verify": False, "gamma_max": 0.9},
    "speculative, stride 3, sync": {"stride": 3, "async_verify": False},
}


class PaddedDocs(Sequence[Document]):
    """The real documents, then `extra` empty distractors, made on access (millions would not fit as objects)."""

    def __init__(self, real: Sequence[Document], extra: int) -> None:
        self.real, self.extra = real, extra

    def __len__(self) -> int:
        return len(self.real) + self.extra

    @overload
    def __getitem__(self, i: int) -> Document: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[Document]: ...
    def __getitem__(self, i: int | slice) -> Document | Sequence[Document]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if i < len(self.real):
            return self.real[i]
        if i >= len(self):
            raise IndexError(i)
        return Document(f"synthetic#{i}", "synthetic", "")


class LargeFaissRetriever(FaissRetriever):
    """FAISS flat over the corpus plus `synthetic` seeded random unit vectors."""

    def __init__(self, corpus: str = "pydoc", *, topk: int = 2, synthetic: int = 0, seed: int = 0) -> None:
        super().__init__(corpus, topk=topk)
        self.synthetic, self.seed = synthetic, seed

    def build(self, vectors: Any) -> None:
        super().build(vectors)
        rng = np.random.default_rng(self.seed)
        for start in range(0, self.synthetic, 100_000):
            block = rng.standard_normal((min(100_000, self.synthetic - start), vectors.shape[1]), dtype=np.float32)
            block /= np.linalg.norm(block, axis=1, keepdims=True)
            self.index.add(block)
        self.docs = PaddedDocs(self.docs, self.synthetic)  # type: ignore[assignment]


class CallTimes:
    """Wall times of the eager calls of chosen component methods, by label (an instance attribute
    shadows each method)."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}

    def wrap(self, component: Any, method: str, label: str) -> None:
        inner = getattr(component, method)
        times = self.seconds.setdefault(label, [])

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - started)

        setattr(component, method, timed_call)

    def reset(self) -> None:
        for times in self.seconds.values():
            times.clear()


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--synthetic", type=int, default=4_000_000, help="random unit vectors added to the index")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--topk", type=int, default=1, help="documents per retrieval (each one lengthens every prompt)")
    parser.add_argument("--llm-threads", type=int, default=2)
    parser.add_argument("--faiss-threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--blas-from", type=int, default=4, help="the smallest batch FAISS searches through BLAS")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import faiss

    faiss.omp_set_num_threads(args.faiss_threads)
    faiss.cvar.distance_compute_blas_threshold = args.blas_from
    example = runpy.run_path(str(ROOT / "examples" / "speculative.py"), run_name="speculative_example")
    base = LargeFaissRetriever("pydoc", topk=args.topk, synthetic=args.synthetic)
    llm = LlamaCppGenerator(max_tokens=example["STEP_TOKENS"], threads=args.llm_threads)
    retrievers = {name: SpeculativeRetriever(base, cache_topk=20, **config) for name, config in CONFIGS.items()}
    started = time.perf_counter()
    base.retrieve("warm up")  # builds the index
    llm.generate("warm up", max_tokens=4)
    for retriever in retrievers.values():
        example["speculative_rounds"](WARM_UP, retriever, llm)  # a warm replica: it has measured a decoding step
        retriever.totals.clear()
        retriever.strides.clear()
    vectors = base.embedder.encode(list(QUESTIONS) * 2)
    search_ms = {n: 1000 * min(timed(base.search, vectors[:n], 20)[1] for _ in range(2)) for n in (1, 2, 3, 4, 8)}
    print(f"ready in {time.perf_counter() - started:.0f} s: {base.index.ntotal:,} vectors; one base search of a "
          "batch of n queries: " + ", ".join(f"n={n} {ms:.0f} ms" for n, ms in search_ms.items()), flush=True)

    calls = CallTimes()
    calls.wrap(llm, "generate", "generation step")
    calls.wrap(base, "retrieve", "retrieval")
    steps: dict[str, list[float]] = {label: [] for label in calls.seconds}
    latencies: dict[str, list[float]] = {"plain": [], **{name: [] for name in retrievers}}
    identical = True
    for n, question in enumerate(QUESTIONS[: args.questions]):
        runs = [("plain", None), *retrievers.items()]
        if n % 2:
            runs.reverse()  # alternate the order: the generator's prompt cache favours neither
        outputs = {}
        for name, retriever in runs:
            calls.reset()
            if retriever is None:
                outputs[name], seconds = timed(example["plain_rounds"], question, base, llm)
                for label, times in calls.seconds.items():
                    steps[label].extend(times)
            else:
                outputs[name], seconds = timed(example["speculative_rounds"], question, retriever, llm)
            latencies[name].append(seconds)
        same = all(output == outputs["plain"] for output in outputs.values())
        identical &= same
        print(f"{question!r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in latencies.items()) + f"; identical: {same}",
              flush=True)

    plain_mean = statistics.mean(latencies["plain"])
    step_ms = {label: 1000 * statistics.mean(times) for label, times in steps.items()}
    results: dict[str, Any] = {
        "vectors": base.index.ntotal, "mean_step_ms": step_ms, "search_ms_by_batch": search_ms,
        "identical_outputs": identical,
        "plain_mean_s": plain_mean, "plain_latencies_s": latencies["plain"], "configs": {},
    }
    print(f"\nplain: mean {plain_mean:.2f} s per request; mean generation step {step_ms['generation step']:.0f} ms, "
          f"mean retrieval {step_ms['retrieval']:.0f} ms")
    for name, retriever in retrievers.items():
        mean = statistics.mean(latencies[name])
        totals = retriever.totals
        checked = totals["hits"] + totals["misses"]
        entry = {
            "mean_s": mean, "speedup": plain_mean / mean, "latencies_s": latencies[name],
            "accuracy": totals["hits"] / checked if checked else None, "strides": dict(sorted(retriever.strides.items())),
            "rollbacks": totals["rollbacks"], "base_searches": totals["verifications"] + args.questions,
            "retrievals": totals["retrievals"],
        }
        results["configs"][name] = entry
        print(f"{name}: mean {mean:.2f} s per request, {entry['speedup']:.2f}x; speculation accuracy "
              f"{entry['accuracy']:.2f}; verification strides {entry['strides']}; rollbacks {entry['rollbacks']}; "
              f"{entry['base_searches']} base searches for {entry['retrievals']} retrievals")
    print(f"identical outputs: {identical}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
