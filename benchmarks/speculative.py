"""Speculative retrieval: latency per request of the iterative example with and without speculation.

    python benchmarks/speculative.py --synthetic 2000000 --json speculative.json

Retriever: exact dense retrieval (FAISS flat, inner product) over the pydoc corpus's real MiniLM
vectors plus `--synthetic` random unit vectors (seeded normal draws, L2-normalised) added to the
same index as distractor documents with empty text. Random directions in 384 dimensions sit near
cosine 0 from every question, so the top hits stay the real pydoc chunks while each search costs
what a corpus of that size costs: one retrieval at least as long as one generation stride.
Generator: SmolLM2-135M-Instruct through llama.cpp, temperature 0. Pipeline: `examples/speculative.py`
(six rounds of 16 tokens, a retrieval after each), run eagerly in this process, once per question
with the plain retriever and once per speculative configuration, in alternating order; the outputs
must be identical. FAISS searches on one thread, llama.cpp on `--llm-threads`.
"""

from __future__ import annotations

import argparse
import json
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
CONFIGS = {
    "speculative, auto stride, async": {"stride": "auto", "async_verify": True},
    "speculative, auto stride, sync": {"stride": "auto", "async_verify": False},
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


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--synthetic", type=int, default=2_000_000, help="random unit vectors added to the index")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--topk", type=int, default=1, help="documents per retrieval (each one lengthens every prompt)")
    parser.add_argument("--llm-threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    import faiss

    faiss.omp_set_num_threads(1)
    example = runpy.run_path(str(ROOT / "examples" / "speculative.py"), run_name="speculative_example")
    base = LargeFaissRetriever("pydoc", topk=args.topk, synthetic=args.synthetic)
    llm = LlamaCppGenerator(max_tokens=example["STEP_TOKENS"], threads=args.llm_threads)
    retrievers = {name: SpeculativeRetriever(base, cache_topk=20, **config) for name, config in CONFIGS.items()}
    started = time.perf_counter()
    base.retrieve("warm up")  # builds the index
    llm.generate("warm up", max_tokens=4)
    for retriever in retrievers.values():
        retriever.start("warm up")
        retriever.totals.clear()
        retriever.strides.clear()
    _, one_retrieval = timed(base.retrieve, "How do I leave a loop?")
    _, one_stride = timed(llm.generate, example["step_prompt"]("How do I leave a loop?", []), base.retrieve("loop"))
    print(f"ready in {time.perf_counter() - started:.0f} s: {base.index.ntotal:,} vectors; one retrieval "
          f"{one_retrieval * 1000:.0f} ms, one generation stride {one_stride * 1000:.0f} ms", flush=True)

    latencies: dict[str, list[float]] = {"plain": [], **{name: [] for name in retrievers}}
    identical = True
    for n, question in enumerate(QUESTIONS[: args.questions]):
        runs = [("plain", None), *retrievers.items()]
        if n % 2:
            runs.reverse()  # alternate the order: the generator's prompt cache favours neither
        outputs = {}
        for name, retriever in runs:
            if retriever is None:
                outputs[name], seconds = timed(example["plain_rounds"], question, base, llm)
            else:
                outputs[name], seconds = timed(example["speculative_rounds"], question, retriever, llm)
            latencies[name].append(seconds)
        same = all(output == outputs["plain"] for output in outputs.values())
        identical &= same
        print(f"{question!r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in latencies.items()) + f"; identical: {same}",
              flush=True)

    plain_mean = statistics.mean(latencies["plain"])
    results: dict[str, Any] = {
        "vectors": base.index.ntotal, "one_retrieval_ms": one_retrieval * 1000, "one_stride_ms": one_stride * 1000,
        "identical_outputs": identical, "plain_mean_s": plain_mean, "configs": {},
    }
    print(f"\nplain: mean {plain_mean:.2f} s per request")
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
