"""Retrieval quality of the default corpus: recall@3 and recall@1 of `FaissRetriever("pydoc")` on a
labelled set of questions about the standard library (`recall_questions.json`), with the misses.

    python benchmarks/recall.py --json recall.json
    python benchmarks/recall.py --variants vector,fused

A question is a hit at k when one of the first k hits is a chunk of a module (or pydoc topic) named
in its `answers`. Variants are retriever options measured on the same questions in one run; the
index (vectors cached under PATCHKIT_CACHE_DIR) is built once and shared by all of them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from patchkit.components import Embedder, FaissRetriever, Hit

QUESTIONS = Path(__file__).with_name("recall_questions.json")

# name -> FaissRetriever keyword arguments; "vector" is the default retriever, the baseline.
VARIANTS: dict[str, dict[str, Any]] = {
    "vector": {},
    "fused": {"lexical": True},  # reciprocal-rank fusion with BM25
}


def load_questions(path: Path = QUESTIONS) -> list[dict[str, Any]]:
    """The labelled set: [{"question": ..., "answers": [module or topic, ...]}, ...]."""
    questions: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    return questions


def source(hit: Hit) -> str:
    """The module or topic a hit is a chunk of: its title, as `Hit.id` is "module:NAME#i" or "topic:NAME#i"."""
    return hit.id.split("#")[0].split(":", 1)[-1]


def evaluate(retriever: FaissRetriever, questions: list[dict[str, Any]], k: int = 3) -> dict[str, Any]:
    """recall@1 and recall@k of `retriever` on `questions`, and each miss at k with what it retrieved."""
    at1 = atk = 0
    misses = []
    for item in questions:
        found = [source(h) for h in retriever.retrieve(item["question"], topk=k)]
        answers = set(item["answers"])
        at1 += bool(found[:1] and found[0] in answers)
        if answers & set(found):
            atk += 1
        else:
            misses.append({"question": item["question"], "answers": item["answers"], "retrieved": found})
    n = len(questions)
    return {"recall@1": at1 / n, f"recall@{k}": atk / n, "questions": n, "misses": misses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--questions", type=Path, default=QUESTIONS)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    names = [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    questions = load_questions(args.questions)
    embedder = Embedder()
    results = {}
    for name in names:
        result = evaluate(FaissRetriever("pydoc", topk=3, embedder=embedder, **VARIANTS[name]), questions)
        results[name] = result
        print(f"{name:>10}: recall@3 {result['recall@3']:.2f}  recall@1 {result['recall@1']:.2f}")
        for miss in result["misses"]:
            print(f"{'':>12}miss: {miss['question']!r} wants {'/'.join(miss['answers'])}, got {', '.join(miss['retrieved'])}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
