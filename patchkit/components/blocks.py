"""RAG building blocks over a generator: prompt augmentation, query rewriting, relevance grading,
and a BM25 search over a local document set with pluggable backends."""

from __future__ import annotations

import math
import re
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from patchkit.component import Component, ensure_setup, make
from patchkit.components.documents import Document, Hit, load_corpus, pydoc_corpus
from patchkit.components.generators import Generator, LlamaCppGenerator, render_context

__all__ = ["Augmenter", "BM25Index", "BM25Search", "Grader", "Rewriter", "WebSearch", "parse_yes_no"]

# Asked with the documents passed as documents: the generator puts them first, so the grader's prompt
# shares its prefix with the answer's over the same documents.
GRADE_INSTRUCTION_WITH_QUESTION = 'Do the documents above answer "{question}"? Reply with one word, yes or no.'
REWRITE_PROMPT = "Rewrite this question as a short search query with the key terms. Reply with the query only.\n\n{question}"


class Augmenter(Component):
    """Puts documents into a prompt with a template naming `{context}` and `{question}`."""

    def __init__(self, template: str = "Documents:\n{context}\n\nQuestion: {question}") -> None:
        missing = [field for field in ("{context}", "{question}") if field not in template]
        if missing:
            raise ValueError(f"the template must contain {' and '.join(missing)}")
        self.template = template

    @make(batch=True, read_only=True)
    def augment(self, question: list[str], docs: list[Sequence[Any]]) -> list[str]:
        return [self.template.format(context=render_context(d), question=q) for q, d in zip(question, docs)]


def parse_yes_no(text: str) -> bool | None:
    """The first yes/no-like word of a model's answer; None when it gives neither."""
    for word in re.findall(r"[a-z]+", text.lower()):
        if word in ("yes", "relevant", "true", "correct"):
            return True
        if word in ("no", "not", "irrelevant", "false", "incorrect"):
            return False
    return None


class Grader(Component):
    """Asks a generator whether retrieved documents answer the question (CRAG's grader).

    The answer is parsed leniently (the first yes/no-like word); an answer with neither counts as
    relevant when the best document's score reaches `min_score`, else as not relevant.
    """

    def __init__(self, generator: Generator | None = None, *, min_score: float = 0.5) -> None:
        self.generator = generator if generator is not None else LlamaCppGenerator(max_tokens=4)
        self.min_score = min_score

    def setup(self) -> None:
        ensure_setup(self.generator)

    @make(max_concurrency=16, read_only=True)  # its calls wait on the generator, which batches them (shared, or its own engine)
    def grade(self, question: str, docs: list[Any]) -> bool:
        if not docs:
            return False
        reply = self.generator.generate(GRADE_INSTRUCTION_WITH_QUESTION.format(question=question), docs, max_tokens=4)
        verdict = parse_yes_no(reply)
        if verdict is None:
            best = max((getattr(d, "score", 0.0) for d in docs), default=0.0)
            return bool(best >= self.min_score)
        return verdict


class Rewriter(Component):
    """Turns a question into a search query with a generator; falls back to the question when the reply is empty."""

    def __init__(self, generator: Generator | None = None) -> None:
        self.generator = generator if generator is not None else LlamaCppGenerator(max_tokens=24)

    def setup(self) -> None:
        ensure_setup(self.generator)

    @make(max_concurrency=16, read_only=True)  # as Grader.grade
    def rewrite(self, question: str) -> str:
        # Explicit: the generator may be one shared with the answering stage, whose default is longer.
        reply = self.generator.generate(REWRITE_PROMPT.format(question=question), max_tokens=24)
        query = reply.strip().strip('"').splitlines()[0].strip() if reply.strip() else ""
        return query or question


class BM25Index:
    """BM25 over a document set: the default backend of `BM25Search`."""

    def __init__(self, docs: Sequence[Document], k1: float = 1.5, b: float = 0.75) -> None:
        self.docs = list(docs)
        self.terms = [Counter(_words(f"{d.title} {d.text}")) for d in self.docs]
        self.lengths = [sum(t.values()) for t in self.terms]
        self.mean_length = sum(self.lengths) / max(1, len(self.lengths))
        frequency = Counter(w for t in self.terms for w in t)
        n = len(self.docs)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in frequency.items()}
        self.k1, self.b = k1, b

    def __call__(self, query: str, topk: int) -> list[Hit]:
        words = _words(query)
        scores = [(self._score(words, i), i) for i in range(len(self.docs))]
        best = sorted((s for s in scores if s[0] > 0), reverse=True)[:topk]
        return [Hit(self.docs[i].id, self.docs[i].title, self.docs[i].text, round(score, 6)) for score, i in best]

    def _score(self, words: list[str], i: int) -> float:
        terms, norm = self.terms[i], self.k1 * (1 - self.b + self.b * self.lengths[i] / self.mean_length)
        return sum(self.idf.get(w, 0.0) * terms[w] * (self.k1 + 1) / (terms[w] + norm) for w in words if w in terms)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


class BM25Search(Component):
    """Search for CRAG's fallback branch, with pluggable backends.

    The default backend is BM25 over a second local document set (the standard library's module
    docstrings, or `corpus=` a directory or a list of texts), returning `Hit`s like the retrievers.
    Pass `backend=callable(query, topk) -> list` to search anything else, the web included; its
    results come back as it returns them.
    """

    def __init__(
        self,
        corpus: str | Sequence[str] = "pydoc-modules",
        *,
        topk: int = 3,
        backend: Callable[[str, int], list[Any]] | None = None,
    ) -> None:
        self.corpus, self.topk, self.backend = corpus, topk, backend

    def setup(self) -> None:
        if self.backend is None:
            docs = pydoc_corpus(topics=False) if self.corpus == "pydoc-modules" else load_corpus(self.corpus)
            self.backend = BM25Index(docs)

    @make(read_only=True)
    def search(self, query: str) -> list[Any]:
        assert self.backend is not None
        return list(self.backend(query, self.topk))


class WebSearch(BM25Search):
    """The former name of `BM25Search`, kept for existing code: the first one made in a process warns."""

    _warned = False  # once per process: a pipeline may make one per request

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not WebSearch._warned:
            WebSearch._warned = True
            message = "WebSearch is now BM25Search; it searches local documents, not the web"
            warnings.warn(message, DeprecationWarning, stacklevel=2)
        super().__init__(*args, **kwargs)
