"""Corrective RAG, the pipeline of the Patchwork paper's Figure 9, on real components.

Retrieve from the Python documentation; an LLM grader judges the documents; when they do not help,
an LLM rewrites the question and a keyword (BM25) search of the same documentation adds what it finds
to them (CRAG's "ambiguous" action: the 135M grader's verdict is weak evidence, so the documents it
rejected stay; it searches no web: the fallback is a second way into the same documents); SmolLM2
answers. `patchkit demo` serves this file.

Run it: `python examples/crag.py`. Serve it: `patchkit serve examples/crag.py`.
"""

from __future__ import annotations

import patchkit
from patchkit.components import BM25Search, FaissRetriever, Grader, LlamaCppGenerator, Rewriter, merge_hits, sources
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
web = BM25Search("pydoc", topk=3)  # all of it: the language reference (loops, with, try) as well as the modules

question = QUESTIONS[0]
with patchkit.capture(run=False, output="result") as pipeline:  # run=False: nothing loads here
    docs = retriever.retrieve(question)
    relevant = grader.grade(question, docs)
    if not relevant:  # CRAG's "ambiguous" action: a small grader is often wrong, so keep what was found
        docs = merge_hits(docs, web.search(rewriter.rewrite(question)))  # its prefix, which the grader evaluated, first
    answer = llm.generate(question, docs)
    result = {"answer": answer, "sources": sources(docs), "graded_relevant": relevant}

if __name__ == "__main__":
    ask(pipeline, QUESTIONS)
