"""A stream of questions that never repeat, over documents whose popularity is skewed.

Questions are made from the pydoc corpus's own modules: one about each module ("What is the csv
module for?") and one about each public function, class and method that has a docstring ("What does
`heapq.heappush` do?"), each with the module that answers it. `draw` orders them into a stream in
which modules are popular by a Zipf law over a seeded random ranking (RAGCache and HedraRAG report
that a small share of documents draws most retrievals), while every question is asked once: the
documents repeat, the questions do not. `popularity` measures the skew a stream actually realised,
from the documents its questions retrieved, and `unshared_tokens` what of its prompts a cache of
prompt prefixes could not serve.

Everything here is deterministic for a given seed and needs no model.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Popularity", "Question", "catalogue", "doc_ids", "draw", "fit_zipf", "popularity", "unshared_tokens"]

# How a question about a definition is phrased: one template each, chosen by the seed.
TEMPLATES = ("What does {subject} do?", "How do I use {subject}?", "What is {subject} for?", "Explain {subject}.")
MIN_QUESTIONS = 10  # a module asked about fewer times than its Zipf share would soon run out of new questions
TOP_SHARE = 0.2  # "the top 20% of documents": HedraRAG's and VectorLiteRAG's measure of skew


@dataclass(frozen=True)
class Question:
    """One question of the stream: its text, what it asks about, and the module whose documents answer it."""

    text: str
    subject: str  # "heapq.heappush", or the module's name for a question about the module
    module: str


def catalogue(modules: Iterable[str], *, seed: int = 0) -> dict[str, list[Question]]:
    """Per module, its distinct questions, in source order: one about the module, then one per public
    definition with a docstring (functions, classes, and their classes' methods). `modules`: the names
    of the corpus's module documents (a `Document`'s title for ids "module:NAME#i"). A module's source
    is parsed, never imported; built-in and extension modules, which have none, are imported to read
    their members, as the corpus itself does."""
    rng = random.Random(seed)
    found: dict[str, list[Question]] = {}
    for module in sorted(set(modules)):
        subjects = [f"{module}.{name}" for name in definitions(module)]
        questions = [Question(f"What is the {module} module for?", module, module)]
        questions += [Question(rng.choice(TEMPLATES).format(subject=s), s, module) for s in dict.fromkeys(subjects)]
        found[module] = questions
    return found


def definitions(module: str) -> list[str]:
    """The public documented definitions of `module` ("reader", "Sniffer.sniff"), in source order; empty
    when it cannot be found or read."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    origin = getattr(spec.loader_state, "filename", None) if spec.origin == "frozen" else spec.origin
    if origin is not None and origin.endswith(".py"):
        return _source_definitions(Path(origin))
    if spec.origin == "built-in" or (origin is not None and origin.endswith(".so")):
        return _member_definitions(module)
    return []


def _source_definitions(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return []
    names = []
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if ast.get_docstring(node):
            names.append(node.name)
        if isinstance(node, ast.ClassDef):
            names += [f"{node.name}.{sub.name}" for sub in node.body
                      if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_")
                      and ast.get_docstring(sub)]
    return names


def _member_definitions(module: str) -> list[str]:
    try:
        loaded = importlib.import_module(module)
    except Exception:  # an extension for another platform, or one missing its system library
        return []
    return [name for name in sorted(vars(loaded))
            if not name.startswith("_") and callable(member := getattr(loaded, name)) and _documented(member)]


def _documented(member: Any) -> bool:
    doc = getattr(member, "__doc__", None)
    return isinstance(doc, str) and bool(doc.strip())


def draw(questions: Mapping[str, Sequence[Question]], count: int, *, s: float = 1.0, seed: int = 0,
         min_questions: int = MIN_QUESTIONS) -> list[Question]:
    """`count` distinct questions in stream order. The modules with at least `min_questions` questions
    are ranked in a random order (seeded); each next question's module is drawn with probability
    proportional to 1 / rank**s among the modules that have questions left, and the question is one of
    that module's not yet asked, at random. A ValueError when the modules hold fewer than `count`."""
    if count < 0 or s < 0:
        raise ValueError(f"count ({count}) and s ({s}) must be >= 0")
    rng = random.Random(seed)
    ranked = [m for m in sorted(questions) if len(questions[m]) >= min_questions]
    rng.shuffle(ranked)
    left = {m: rng.sample(list(questions[m]), len(questions[m])) for m in ranked}
    available = sum(map(len, left.values()))
    if count > available:
        raise ValueError(f"{count} questions asked for, but the {len(ranked)} modules with >= {min_questions} questions "
                         f"hold {available}; lower count or min_questions")
    weights = {m: 1.0 / (rank + 1) ** s for rank, m in enumerate(ranked)}
    stream: list[Question] = []
    while len(stream) < count:
        live = [m for m in ranked if left[m]]
        module = rng.choices(live, weights=[weights[m] for m in live])[0]
        stream.append(left[module].pop())
    return stream


def doc_ids(docs: Sequence[Any]) -> list[str]:
    """The ids of retrieved hits, in order: the pipeline's record of which documents an answer read."""
    return [str(getattr(doc, "id", doc)) for doc in docs]


@dataclass(frozen=True)
class Popularity:
    """How skewed a stream's retrievals were. `top_share`: the share of retrievals that went to the most
    retrieved 20% of the documents retrieved at least once; `top_corpus_share`: to the most retrieved 20%
    of the whole corpus (as HedraRAG counts clusters; near 1 for a stream much shorter than the corpus);
    `repeat_share`: retrievals of a document already retrieved earlier in the stream (what a cache of
    documents could serve); `zipf_s`: the Zipf exponent fitted to the documents' counts by rank."""

    retrievals: int
    documents: int
    corpus: int
    top_share: float
    top_corpus_share: float
    repeat_share: float
    zipf_s: float

    def describe(self) -> str:
        """One line; the corpus-wide share only where the stream could leave it below 100%."""
        corpus = f"top 20% of the corpus: {100 * self.top_corpus_share:.0f}%; " if self.top_corpus_share < 1 else ""
        return (f"{self.retrievals} retrievals of {self.documents} distinct documents (corpus {self.corpus}); "
                f"top 20% of those retrieved: {100 * self.top_share:.0f}% of retrievals; {corpus}"
                f"repeats: {100 * self.repeat_share:.0f}%; Zipf s = {self.zipf_s:.2f}")


def popularity(retrieved: Sequence[Sequence[str]], corpus: int) -> Popularity:
    """The skew of `retrieved` (per question, the ids of the documents it retrieved) over a corpus of
    `corpus` documents."""
    ids = [doc for docs in retrieved for doc in docs]
    if not ids:
        raise ValueError("no retrievals to measure")
    counts = sorted(Counter(ids).values(), reverse=True)
    if corpus < len(counts):
        raise ValueError(f"corpus ({corpus}) must be >= the {len(counts)} distinct documents retrieved")
    return Popularity(
        retrievals=len(ids),
        documents=len(counts),
        corpus=corpus,
        top_share=sum(counts[: math.ceil(TOP_SHARE * len(counts))]) / len(ids),
        top_corpus_share=sum(counts[: math.ceil(TOP_SHARE * corpus)]) / len(ids),
        repeat_share=(len(ids) - len(counts)) / len(ids),
        zipf_s=fit_zipf(counts),
    )


def fit_zipf(counts: Sequence[int]) -> float:
    """The maximum-likelihood Zipf exponent s for items drawn `counts[r]` times, ranked by count (most
    first), over the items seen: the s at which the mean log-rank under P(r) ~ 1 / r**s equals the
    observed one. Ranking by the observed counts biases s upwards in short streams; s = 0 is uniform."""
    ordered = sorted((c for c in counts if c > 0), reverse=True)
    if len(ordered) < 2:
        return math.inf if ordered else 0.0
    logs = [math.log(rank) for rank in range(1, len(ordered) + 1)]
    observed = sum(c * log for c, log in zip(ordered, logs)) / sum(ordered)

    def expected(s: float) -> float:  # decreasing in s
        weights = [math.exp(-s * log) for log in logs]
        return sum(w * log for w, log in zip(weights, logs)) / sum(weights)

    low, high = 0.0, 16.0
    if observed >= expected(low):
        return 0.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if expected(middle) > observed else (low, middle)
    return (low + high) / 2


def unshared_tokens(prompts: Sequence[Sequence[int]]) -> list[int]:
    """Per prompt, in stream order, its tokens past the longest prefix it shares with any earlier prompt:
    what an unbounded cache of prefixes would still evaluate (at least the last token, for its logits)."""
    trie: dict[int, Any] = {}
    found = []
    for prompt in prompts:
        node, shared = trie, 0
        for token in prompt:
            if token not in node:
                break
            node, shared = node[token], shared + 1
        found.append(max(1, len(prompt) - shared))
        node = trie
        for token in prompt:
            node = node.setdefault(token, {})
    return found
