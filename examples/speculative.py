"""Speculative retrieval in an Iter-RetGen-shaped loop: each of twelve rounds the LLM writes a few more
tokens of reasoning from the documents so far, and what it wrote retrieves the documents for the
next round; the reasoning is the answer.

`plain` is that pipeline over FAISS. `pipeline` is the same one over a `SpeculativeRetriever`: its
retrievals are answered from a per-request cache and verified in batches, in the background while
the LLM writes; when a verification finds a wrong answer, the loop drops the thoughts written
since that retrieval and writes them again from its true documents. Its outputs are those of
`plain`, always; it gets there with fewer waits on the index.

Run it: `python examples/speculative.py`. Serve it: `patchkit serve examples/speculative.py`.
"""

from __future__ import annotations

from typing import Any

import patchkit
from patchkit.components import FaissRetriever, LlamaCppGenerator, SpeculativeRetriever, sources
from patchkit.demo import ask

QUESTIONS = ("Which statement do I use to leave a loop early?", "How do I make a class usable in a with statement?")
ROUNDS = 12
STEP_TOKENS = 8  # a generation stride: a few tokens, then retrieve again
STEP_PROMPT = "Question: {question}\nReasoning so far: {thoughts}\nWrite the next sentence of the reasoning."


def step_prompt(question: str, thoughts: list[str]) -> str:
    return STEP_PROMPT.format(question=question, thoughts=" ".join(thoughts) or "(none yet)")


def finished(thoughts: list[str]) -> bool:
    return len(thoughts) >= ROUNDS


def plain_rounds(question: str, base: FaissRetriever, llm: LlamaCppGenerator) -> dict[str, Any]:
    """The loop over the plain retriever: retrieve, write, retrieve with what was written, ..."""
    docs = base.retrieve(question)
    thoughts: list[str] = []
    while True:
        thought = llm.generate(step_prompt(question, thoughts), docs)
        thoughts.append(thought)
        if finished(thoughts):
            break
        docs = base.retrieve(thought)
    return {"answer": " ".join(thoughts), "thoughts": thoughts, "sources": sources(docs)}


def speculative_rounds(question: str, retriever: SpeculativeRetriever, llm: LlamaCppGenerator) -> dict[str, Any]:
    """The same loop over the speculative retriever, rolling back from the first wrong retrieval."""
    state = retriever.start(question)
    thoughts: list[str] = []
    while True:
        thought = llm.generate(step_prompt(question, thoughts), state.docs)
        thoughts.append(thought)
        if finished(thoughts):
            state = retriever.settle(state)  # every answer verified before the output rests on them
        else:
            state = retriever.retrieve(state, thought)
        if state.rollback is not None:
            thoughts = thoughts[: state.rollback]  # redo from the first wrong retrieval, with its true docs
        elif finished(thoughts):
            break
    return {"answer": " ".join(thoughts), "thoughts": thoughts, "sources": sources(state.docs)}


base = FaissRetriever("pydoc", topk=2)
retriever = SpeculativeRetriever(base, cache_topk=20, stride="auto", async_verify=True)
llm = LlamaCppGenerator(max_tokens=STEP_TOKENS)

question = QUESTIONS[0]
with patchkit.capture(run=False, output="result") as plain:  # run=False: nothing loads here
    result = plain_rounds(question, base, llm)

with patchkit.capture(run=False, output="result") as pipeline:  # the last capture: what `patchkit serve` serves
    result = speculative_rounds(question, retriever, llm)

if __name__ == "__main__":
    ask(pipeline, QUESTIONS)
