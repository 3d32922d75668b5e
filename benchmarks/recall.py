"""Retrieval quality of `patchkit demo`: recall@3 and recall@1 of the retriever examples/crag.py builds,
on three labelled sets of questions about Python and its standard library, with the misses.

    python benchmarks/recall.py --json recall.json
    python benchmarks/recall.py --variants demo,fused --sets fresh
    python benchmarks/recall.py --pipeline

The sets: `labelled` (recall_questions.json, 20 questions), `fresh` (recall_questions_fresh.json, 20
more, written later in other words and used to choose no setting: a check that the figures hold on
questions nobody tuned for) and `demo` (recall_questions_demo.json: the 8 questions `patchkit demo`
asks, which are examples/crag.py's QUESTIONS). A question is a hit at k when one of the first k hits
is a chunk of a module or pydoc topic named in its `answers`.

Variant "demo" is the retriever the demo serves, examples/crag.py's own; the others change one of its
options, on the same questions and the same cached vectors (PATCHKIT_CACHE_DIR) in one run.

`--pipeline` also runs the demo's whole CRAG pipeline in this process on the demo's questions and
counts the answers whose shown sources include an answering module: what `patchkit demo` prints, after
the grader (SmolLM2-135M) and, where it rejects the documents, the rewrite and the fallback search. It
loads the LLM: a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from patchkit.components import FaissRetriever, Hit

HERE = Path(__file__).parent
SETS = {
    "labelled": HERE / "recall_questions.json",
    "fresh": HERE / "recall_questions_fresh.json",
    "demo": HERE / "recall_questions_demo.json",
}
QUESTIONS = SETS["labelled"]

# name -> options changed from the demo's retriever; "demo" is the retriever as examples/crag.py builds it.
VARIANTS: dict[str, dict[str, Any]] = {
    "demo": {},
    "fused": {"lexical": True},  # reciprocal-rank fusion with BM25
}


def load_questions(path: Path = QUESTIONS) -> list[dict[str, Any]]:
    """A labelled set: [{"question": ..., "answers": [module or topic, ...]}, ...]."""
    questions: list[dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    return questions


def demo_retriever(**options: Any) -> FaissRetriever:
    """The retriever `patchkit demo` serves (examples/crag.py's), or a new one like it with `options` changed."""
    from patchkit.examples import crag

    if not options:
        return crag.retriever
    spec = crag.retriever._patchkit_spec
    return FaissRetriever(*spec.args, **{**spec.kwargs, **options})


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
    return {"recall@1": at1 / n, f"recall@{k}": atk / n, "hits@3": atk, "questions": n, "misses": misses}


def evaluate_pipeline(questions: list[dict[str, Any]]) -> dict[str, Any]:
    """The demo's CRAG pipeline run here on `questions`: how many answers show an answering source."""
    from patchkit.examples import crag

    right = 0
    shown = []
    for item in questions:
        output = crag.pipeline(question=item["question"])
        hit = bool(set(item["answers"]) & set(output["sources"]))
        right += hit
        shown.append({
            "question": item["question"], "answers": item["answers"], "sources": output["sources"],
            "graded_relevant": output["graded_relevant"], "right": hit,
        })
    return {"right": right, "questions": len(questions), "shown": shown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    parser.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of: {', '.join(SETS)}")
    parser.add_argument("--pipeline", action="store_true", help="also run the demo's CRAG pipeline on the demo's questions")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    variants, sets = _names(parser, args.variants, VARIANTS, "variants"), _names(parser, args.sets, SETS, "sets")
    questions = {name: load_questions(SETS[name]) for name in sets}
    results: dict[str, Any] = {}
    for variant in variants:
        retriever = demo_retriever(**VARIANTS[variant])
        results[variant] = {name: evaluate(retriever, qs) for name, qs in questions.items()}
        for name, result in results[variant].items():
            hits, n, first = result["hits@3"], result["questions"], result["recall@1"]
            print(f"{variant:>6} {name:>8}: recall@3 {hits:2d}/{n}  recall@1 {first:.2f}")
            for miss in result["misses"]:
                print(f"{'':>18}miss: {miss['question']!r} wants {'/'.join(miss['answers'])}, got {', '.join(miss['retrieved'])}")
    if args.pipeline:
        results["pipeline"] = pipeline = evaluate_pipeline(load_questions(SETS["demo"]))
        print(f"pipeline     demo: right sources shown {pipeline['right']}/{pipeline['questions']}")
        for row in pipeline["shown"]:
            mark = "  " if row["right"] else "x "
            print(f"{'':>16}{mark}{row['question']!r}: {', '.join(row['sources'])} (graded relevant: {row['graded_relevant']})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


def _names(parser: argparse.ArgumentParser, given: str, known: dict[str, Any], what: str) -> list[str]:
    names = [name for name in given.split(",") if name]
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"unknown {what} {unknown}; choose from {list(known)}")
    return names


if __name__ == "__main__":
    main()
