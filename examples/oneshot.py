"""One-shot RAG: retrieve from the Python documentation, then answer with SmolLM2.

Run it: `python examples/oneshot.py` deploys the pipeline on worker processes and asks it a few
questions. Serve it: `patchkit serve examples/oneshot.py`, then
`curl -d '{"inputs": {"question": "What does a with statement do?"}}' http://127.0.0.1:8000/v1/query`.
"""

from __future__ import annotations

import patchkit
from patchkit.components import FaissRetriever, LlamaCppGenerator, sources
from patchkit.demo import ask

QUESTIONS = ("How do I catch an exception?", "What does a with statement do?", "How do I define a function?")

retriever = FaissRetriever("pydoc", topk=3)
llm = LlamaCppGenerator(max_tokens=64)

question = QUESTIONS[0]
with patchkit.capture(run=False, output="result") as pipeline:  # run=False: nothing loads here
    docs = retriever.retrieve(question)
    answer = llm.generate(question, docs)
    result = {"answer": answer, "sources": sources(docs)}

if __name__ == "__main__":
    ask(pipeline, QUESTIONS)
