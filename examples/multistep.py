"""Multi-step RAG: the LLM splits the question into sub-questions, each retrieves its own documents,
and the LLM answers the whole question from all of them. The number of retrievals depends on the
plan the LLM writes.

Run it: `python examples/multistep.py`. Serve it: `patchkit serve examples/multistep.py`.
"""

from __future__ import annotations

import re

import patchkit
from patchkit.components import FaissRetriever, LlamaCppGenerator, merge_hits, sources
from patchkit.demo import ask

QUESTIONS = (
    "What is the difference between a list and a tuple?",
    "How do I read a file and handle the error when it does not exist?",
)
PLAN_PROMPT = (
    "Split this question into at most three short sub-questions, one per line, with no other text.\n\n{question}"
)


def plan_prompt(question: str) -> str:
    return PLAN_PROMPT.format(question=question)


def sub_questions(plan: str, question: str, limit: int = 3) -> list[str]:
    """The plan's lines, list markers stripped; the question itself when the plan has none."""
    lines = [re.sub(r"^\s*(?:[-*]|\d+[.)])\s*", "", line).strip() for line in plan.splitlines()]
    return [line for line in lines if len(line.split()) >= 2][:limit] or [question]


retriever = FaissRetriever("pydoc", topk=2)
llm = LlamaCppGenerator(max_tokens=64)

question = QUESTIONS[0]
with patchkit.capture(run=False, output="result") as pipeline:  # run=False: nothing loads here
    plan = llm.generate(plan_prompt(question), max_tokens=48)
    steps = sub_questions(plan, question)
    docs = []
    for step in steps:
        docs = merge_hits(docs, retriever.retrieve(step))
    answer = llm.generate(question, docs)
    result = {"answer": answer, "sources": sources(docs), "sub_questions": steps}

if __name__ == "__main__":
    ask(pipeline, QUESTIONS)
