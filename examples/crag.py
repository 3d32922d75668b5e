"""Corrective RAG, the pipeline of the Patchwork paper's Figure 9, on real components.

Retrieve from the Python documentation; an LLM grader judges the documents; when they do not help,
an LLM rewrites the question and a search over a second document set (the standard library's module
docstrings: it searches no web) replaces them; SmolLM2 answers. `patchkit demo` serves this file.

Run it: `python examples/crag.py`. Serve it: `patchkit serve examples/crag.py`.
"""

from __future__ import annotations

import patchkit
from patchkit.components import BM25Search, FaissRetriever, Grader, LlamaCppGenerator, Rewriter, sources
from patchkit.demo import ask

QUESTIONS = (
    "How do I catch an exception in Python?",
    "What does the with statement do?",
    "Which module reads and writes CSV files?",
    "How do I run code when a loop finishes without break?",
    "What is a generator?",
    "Which module parses command-line arguments?",
    "How do I define a class with data fields automatically?",
    "Which module gives date and time types?",
)

retriever = FaissRetriever("pydoc", topk=3)
llm = LlamaCppGenerator(max_tokens=64)
grader = Grader(llm)  # given the llm, the grader and the rewriter share its one deployment:
rewriter = Rewriter(llm)  # one engine batches their calls, and grading and answering share its prefix cache
web = BM25Search(topk=3)

question = QUESTIONS[0]
with patchkit.capture(run=False, output="result") as pipeline:  # run=False: nothing loads here
    docs = retriever.retrieve(question)
    relevant = grader.grade(question, docs)
    if not relevant:
        docs = web.search(rewriter.rewrite(question))
    answer = llm.generate(question, docs)
    result = {"answer": answer, "sources": sources(docs), "graded_relevant": relevant}

if __name__ == "__main__":
    ask(pipeline, QUESTIONS)
