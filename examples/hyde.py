"""HyDE: the LLM first writes a hypothetical passage answering the question; the passage, not the
question, is what retrieval embeds; then the LLM answers from the real documents found.

Run it: `python examples/hyde.py`. Serve it: `patchkit serve examples/hyde.py`.
"""

from __future__ import annotations

import patchkit
from patchkit.components import FaissRetriever, LlamaCppGenerator, sources
from patchkit.demo import ask

QUESTIONS = ("How do I catch an exception?", "How can a function return values lazily, one at a time?")
PASSAGE_PROMPT = "Write a short passage of the Python documentation that answers this question.\n\n{question}"

def passage_prompt(question: str) -> str:
    return PASSAGE_PROMPT.format(question=question)


retriever = FaissRetriever("pydoc", topk=3)
llm = LlamaCppGenerator(max_tokens=64)

question = QUESTIONS[0]
with patchkit.capture(run=False, output="result") as pipeline:  # run=False: nothing loads here
    passage = llm.generate(passage_prompt(question))
    docs = retriever.retrieve(passage)
    answer = llm.generate(question, docs)
    result = {"answer": answer, "sources": sources(docs), "passage": passage}

if __name__ == "__main__":
    ask(pipeline, QUESTIONS)
