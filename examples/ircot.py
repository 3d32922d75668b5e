"""IRCoT: interleaved retrieval and chain of thought. Each round the LLM writes one more reasoning
sentence from the documents so far, and that sentence retrieves more documents; the loop ends when
a sentence gives the answer, or after three rounds: the number of rounds depends on the model.

Run it: `python examples/ircot.py`. Serve it: `patchkit serve examples/ircot.py`.
"""

from __future__ import annotations

import patchkit
from patchkit.components import FaissRetriever, LlamaCppGenerator, merge_hits, sources
from patchkit.demo import ask

QUESTIONS = ("Which statement do I use to leave a loop early?", "How do I make a class usable in a with statement?")
STEP_PROMPT = (
    "Question: {question}\nReasoning so far: {thoughts}\n"
    "Write the next sentence of reasoning. When you know the answer, write 'So the answer is' and the answer."
)
ANSWER_MARK = "answer is"


def step_prompt(question: str, thoughts: list[str]) -> str:
    return STEP_PROMPT.format(question=question, thoughts=" ".join(thoughts) or "(none yet)")


def gives_answer(thought: str) -> bool:
    return ANSWER_MARK in thought.lower()


def final_answer(thoughts: list[str]) -> str:
    """The text after 'answer is' in the last thought that has it; else the last thought."""
    for thought in reversed(thoughts):
        at = thought.lower().find(ANSWER_MARK)
        if at >= 0:
            return thought[at + len(ANSWER_MARK) :].strip(" :.") or thought
    return thoughts[-1] if thoughts else ""


retriever = FaissRetriever("pydoc", topk=2)
llm = LlamaCppGenerator(max_tokens=48)

question = QUESTIONS[0]
with patchkit.capture(run=False, output="result") as pipeline:  # run=False: nothing loads here
    docs = retriever.retrieve(question)
    thoughts = []
    while len(thoughts) < 3:
        thought = llm.generate(step_prompt(question, thoughts), docs)
        thoughts.append(thought)
        if gives_answer(thought):
            break
        docs = merge_hits(docs, retriever.retrieve(thought))
    result = {"answer": final_answer(thoughts), "sources": sources(docs), "rounds": len(thoughts)}

if __name__ == "__main__":
    ask(pipeline, QUESTIONS)
