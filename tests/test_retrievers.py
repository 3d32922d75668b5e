"""The real retrievers: MiniLM embeddings over the pydoc corpus in FAISS, Chroma and Qdrant."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sentence_transformers", reason="the Embedder needs sentence-transformers: pip install -e '.[retrieval]'")
pytest.importorskip("faiss", reason="the retrievers search FAISS indexes: pip install -e '.[retrieval]'")

import patchkit  # noqa: E402
from patchkit.components import ChromaRetriever, Embedder, FaissRetriever, Hit, QdrantRetriever  # noqa: E402
from patchkit.components.documents import Document, chunk, from_directory, pydoc_corpus  # noqa: E402
from patchkit.core import ensure_setup  # noqa: E402

pytestmark = pytest.mark.slow

# Questions whose answer is one pydoc topic (or module), as a user would ask them.
KNOWN = {
    "How do I catch an exception and handle the error?": {"try", "exceptions"},
    "What does the with statement do with a context manager?": {"with", "context-managers"},
    "How does a generator function yield values?": {"yield", "yieldexpr", "typesseq"},
}


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    monkey = pytest.MonkeyPatch()
    monkey.setenv("PATCHKIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield
    monkey.undo()


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder()


@pytest.mark.parametrize("kind", ["faiss-flat", "faiss-ivf", "chroma", "qdrant"])
def test_each_store_finds_the_right_pydoc_topic(kind: str, embedder: Embedder) -> None:
    retriever = {
        "faiss-flat": lambda: FaissRetriever("pydoc", topk=3, embedder=embedder),
        "faiss-ivf": lambda: FaissRetriever("pydoc", topk=3, index="ivf", nprobe=16, embedder=embedder),
        "chroma": lambda: ChromaRetriever("pydoc", topk=3, embedder=embedder),
        "qdrant": lambda: QdrantRetriever("pydoc", topk=3, embedder=embedder),
    }[kind]()
    for question, topics in KNOWN.items():
        hits = retriever.retrieve(question)
        assert len(hits) == 3 and all(isinstance(h, Hit) for h in hits)
        assert hits[0].title in topics, (question, [h.title for h in hits])
        assert hits[0].score >= hits[1].score >= hits[2].score


def test_the_stores_agree_with_exact_search(embedder: Embedder) -> None:
    flat = FaissRetriever("pydoc", topk=5, embedder=embedder)
    others = [ChromaRetriever("pydoc", topk=5, embedder=embedder), QdrantRetriever("pydoc", topk=5, embedder=embedder)]
    for question in KNOWN:
        exact = [h.id for h in flat.retrieve(question)]
        for other in others:
            assert [h.id for h in other.retrieve(question)][:3] == exact[:3]


def test_a_batch_answers_like_single_calls(embedder: Embedder) -> None:
    retriever = FaissRetriever("pydoc", topk=2, embedder=embedder)
    questions = list(KNOWN)
    batched = type(retriever).retrieve.run_batch(retriever, [((q,), {}) for q in questions])
    assert batched == [retriever.retrieve(q) for q in questions]
    assert len(retriever.retrieve(questions[0], topk=5)) == 5


def test_texts_and_directories_are_corpora(tmp_path: Path, embedder: Embedder) -> None:
    (tmp_path / "cats.md").write_text("Cats purr when they are content and sleep most of the day.")
    (tmp_path / "rust.txt").write_text("The borrow checker enforces ownership rules at compile time.")
    assert [d.title for d in from_directory(tmp_path)] == ["cats.md", "rust.txt"]
    hits = FaissRetriever(str(tmp_path), topk=1, embedder=embedder).retrieve("Why does my cat purr?")
    assert hits[0].title == "cats.md"
    corpus = ["Paris is the capital of France.", "Photosynthesis makes sugar from light."]
    texts = FaissRetriever(corpus, topk=1, embedder=embedder)
    assert texts.retrieve("What is the capital of France?")[0].text == "Paris is the capital of France."


def test_chunks_overlap() -> None:
    words = " ".join(str(i) for i in range(100))
    parts = chunk("t", words, source="s", words=40, overlap=10)
    assert [p.text.split()[0] for p in parts] == ["0", "30", "60"]
    assert parts[-1].text.split()[-1] == "99" and parts[1].id == "s#1"


def test_the_pydoc_corpus_is_kept_in_the_cache_and_read_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path))
    built = pydoc_corpus()
    [kept] = (tmp_path / "corpus").glob("pydoc-*.json")
    assert pydoc_corpus() == built and len(built) > 500
    kept.write_text('[["topic:x#0", "x", "what the kept file says"]]')  # what is read is the kept file
    assert pydoc_corpus() == [Document("topic:x#0", "x", "what the kept file says")]
    kept.write_text("[damaged")  # read again from the sources, and kept again
    assert pydoc_corpus() == built == pydoc_corpus()
    assert len(pydoc_corpus(topics=False)) < len(built) and len(list((tmp_path / "corpus").glob("pydoc-*.json"))) == 2


def test_bad_corpora_are_clear_errors(tmp_path: Path, embedder: Embedder) -> None:
    with pytest.raises(FileNotFoundError, match="neither 'pydoc' nor a directory"):
        FaissRetriever("/no/such/dir", embedder=embedder)
    with pytest.raises(ValueError, match="empty list"):
        FaissRetriever([], embedder=embedder)
    with pytest.raises(FileNotFoundError, match="not a sentence-transformers model directory"):
        Embedder(model=str(tmp_path))
    with pytest.raises(ValueError, match="holds no text"):
        patchkit.components.FaissRetriever(str(tmp_path), embedder=embedder).retrieve("x")


def test_an_unreachable_qdrant_server_is_a_clear_error(embedder: Embedder) -> None:
    retriever = QdrantRetriever(["some text to index"], url="http://127.0.0.1:9", embedder=embedder)
    with pytest.raises(ConnectionError, match="cannot reach Qdrant at http://127.0.0.1:9.*path="):
        retriever.retrieve("x")


def test_a_retriever_deploys_on_a_worker(embedder: Embedder) -> None:
    retriever = FaissRetriever("pydoc", topk=2)

    def ask(question: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return [hit.title for hit in retriever.retrieve(question)]
        return pipeline

    ask("x")
    with patchkit.deploy(patchkit.last_pipeline()) as endpoint:
        titles = endpoint.query(question="How do I catch an exception and handle the error?")
    assert titles[0] in KNOWN["How do I catch an exception and handle the error?"]


def test_lexical_fuses_the_vector_and_bm25_rankings_by_reciprocal_rank(embedder: Embedder) -> None:
    from patchkit.components.blocks import BM25Index

    corpus = [
        "Cats purr when they are content.",
        "The zebra quasar catalogue lists striped stars.",
        "Dogs bark at strangers.",
        "Photosynthesis makes sugar from light.",
        "A quasar is a bright galactic nucleus.",
    ]
    question = "Which catalogue lists the zebra quasar?"
    dense = [h.id for h in FaissRetriever(corpus, topk=len(corpus), embedder=embedder).retrieve(question)]
    fused = FaissRetriever(corpus, topk=3, embedder=embedder, lexical=True)
    ensure_setup(fused)
    lexical = [h.id for h in BM25Index(fused.docs)(question, len(corpus))]
    scores = {doc.id: 0.0 for doc in fused.docs}
    for ranking in (dense, lexical):
        for rank, doc_id in enumerate(ranking, start=1):
            scores[doc_id] += 1 / (60 + rank)
    order = {doc.id: i for i, doc in enumerate(fused.docs)}
    expected = sorted(scores, key=lambda d: (-scores[d], order[d]))[:3]
    hits = fused.retrieve(question)
    assert [h.id for h in hits] == expected
    assert [h.score for h in hits] == [round(scores[d], 6) for d in expected]
    assert hits[0].text == corpus[1]  # first in both rankings
    batched = type(fused).retrieve.run_batch(fused, [((question,), {}), (("Why do cats purr?",), {})])
    assert batched[0] == hits  # the same in a batch, and on every call
