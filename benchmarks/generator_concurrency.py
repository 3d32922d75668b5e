"""Generator tokens/s through a deployed endpoint at 1, 4, 8 and 16 concurrent calls, against one stream.

    python benchmarks/generator_concurrency.py [--seconds 30] [--levels 1,4,8,16]

Deploys `answer = llm.generate(question, docs)` with `LlamaCppGenerator` (the bundled SmolLM2-135M,
one replica with every core), the documents being the pydoc retriever's top 3 for each of the
labelled questions of `benchmarks/recall_questions.json`, computed here first. At each level, that
many clients ask in a closed loop for `--seconds` (`patchkit.bench.run_closed`). The generated
tokens, decode steps and prompt tokens come from the replica's own counters (`stats()`), taken as
differences over the level, so they count exactly what the engine did.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import patchkit  # noqa: E402
from patchkit.bench import run_closed  # noqa: E402
from patchkit.components import FaissRetriever, LlamaCppGenerator  # noqa: E402
from patchkit.tables import text_table  # noqa: E402

COUNTERS = ("generated_tokens", "decode_steps", "decoded_sequences", "prompt_tokens_evaluated", "prompt_tokens_reused")


def questions_with_docs() -> list[dict[str, Any]]:
    questions = [q["question"] for q in json.loads((ROOT / "benchmarks" / "recall_questions.json").read_text())]
    retriever = FaissRetriever("pydoc", topk=3)
    return [{"question": q, "docs": [f"{h.title}: {h.text}" for h in retriever.retrieve(q)]} for q in questions]


def engine_counters(endpoint: patchkit.Endpoint) -> dict[str, float]:
    [report] = [r for r in endpoint.stats()["replica_reports"].values() if r.get("component") == "llm"]
    return {key: float(report["component_stats"].get(key, 0)) for key in COUNTERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--levels", default="1,4,8,16")
    args = parser.parse_args()
    inputs = questions_with_docs()
    llm = LlamaCppGenerator(max_tokens=64)

    def answer(question: str, docs: list[str]) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return llm.generate(question, docs)
        return pipeline

    rows, base = [], None
    with patchkit.deploy(answer(inputs[0]["question"], inputs[0]["docs"]), request_timeout_s=600) as endpoint:
        for level in (int(x) for x in args.levels.split(",")):
            before = engine_counters(endpoint)
            result = run_closed(endpoint.url, concurrency=level, seconds=args.seconds, inputs=inputs, timeout_s=600)
            after = engine_counters(endpoint)
            done = {key: after[key] - before[key] for key in COUNTERS}
            tokens_s = done["generated_tokens"] / result.elapsed_s  # the run and its last replies, all the engine did
            base = base or tokens_s
            rows.append((
                str(level), f"{result.summary()['ok'] / result.elapsed_s:.2f}", f"{tokens_s:.1f}", f"{tokens_s / base:.2f}x",
                f"{done['decoded_sequences'] / max(1.0, done['decode_steps']):.2f}",
                f"{done['prompt_tokens_evaluated']:.0f}", f"{done['prompt_tokens_reused']:.0f}",
            ))
    header = ("concurrent", "calls/s", "generated tokens/s", "vs 1", "sequences/step", "prompt evaluated", "prompt reused")
    print(text_table(header, rows))


if __name__ == "__main__":
    main()
