"""Dense retrievers over FAISS, Chroma (embedded) and Qdrant (local mode or a server), one interface.

`retriever.retrieve(query, topk=None)` takes one question in pipeline code and returns its `Hit`s,
best first; underneath it is a `@make(batch=True)` method, so a deployment embeds and searches a
whole batch of questions at once. Every retriever embeds its corpus with an `Embedder` in `setup()`
(with a progress bar), caching the vectors on disk keyed by corpus, embedder and chunking.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from patchkit import envs
from patchkit.components.documents import Hit, fingerprint, load_corpus
from patchkit.components.embedder import Embedder
from patchkit.core import Component, ensure_setup, make

__all__ = ["ChromaRetriever", "FaissRetriever", "QdrantRetriever", "VectorRetriever"]

logger = logging.getLogger(__name__)

Vectors = np.ndarray[Any, np.dtype[np.float32]]


RRF_K = 60  # reciprocal-rank fusion's damping constant (Cormack et al., 2009)
FUSION_DEPTH = 50  # how far down each ranking fusion looks


class VectorRetriever(Component):
    """The shared part: corpus, embedder, cached vectors, batched `retrieve`. Subclasses index and search.

    `lexical=True` fuses the vector ranking with BM25 over the same chunks by reciprocal-rank fusion:
    each chunk scores the sum of 1 / (60 + rank) over the two rankings (their first 50 each), ties
    broken by corpus order, so the result is exactly deterministic; a hit's `score` is then that sum,
    not a cosine similarity. It finds the chunk that names a question's words ("CSV", "SHA-256")
    where the embedding alone ranks a merely similar topic first.

    Args:
        corpus: "pydoc" (the Python documentation this interpreter ships), a directory of text files, or a
            list of texts.
        topk: how many hits `retrieve` returns unless its call says otherwise.
        embedder: embeds the corpus (in `setup()`) and the queries (default: an `Embedder`).
        lexical: fuse the vector ranking with BM25's, as above.

    Raises:
        ValueError: `topk` below 1, or an empty list of texts.
        FileNotFoundError: a corpus that is neither "pydoc" nor a directory.
    """

    in_place = ("embedder",)  # it embeds the corpus with it in setup(): a private part, not a shared deployment

    def __init__(
        self, corpus: str | Sequence[str] = "pydoc", *, topk: int = 3, embedder: Embedder | None = None, lexical: bool = False
    ) -> None:
        if topk < 1:
            raise ValueError(f"topk must be >= 1; got {topk}")
        if not isinstance(corpus, str) and not corpus:
            raise ValueError("the corpus is an empty list; give texts, a directory of .txt/.md files, or 'pydoc'")
        if isinstance(corpus, str) and corpus != "pydoc" and not Path(corpus).is_dir():
            raise FileNotFoundError(f"corpus {corpus!r} is neither 'pydoc' nor a directory of .txt/.md files")
        self.corpus = corpus if isinstance(corpus, str) else list(corpus)
        self.topk = topk
        self.embedder = embedder if embedder is not None else Embedder()
        self.lexical = lexical

    def version_files(self) -> list[str]:
        """The corpus directory (a file added, changed or removed is a new version) and the embedder's model."""
        own = [self.corpus] if isinstance(self.corpus, str) and self.corpus != "pydoc" else []
        return [*own, *map(str, self.embedder.version_files())]

    def setup(self) -> None:
        """Load the corpus, embed it (cached on disk by its fingerprint and the model), index it."""
        ensure_setup(self.embedder)
        self.docs = load_corpus(self.corpus)
        vectors = self._vectors()
        self.build(vectors)
        if self.lexical:
            from patchkit.components.blocks import BM25Index

            self.bm25 = BM25Index(self.docs)
            self.positions = {doc.id: i for i, doc in enumerate(self.docs)}

    def _vectors(self) -> Vectors:
        key = f"{fingerprint(self.docs)}-{self.embedder.name}"
        path = envs.cache_dir() / "vectors" / f"{key}.npy"
        if path.is_file():
            vectors: Vectors = np.load(path)
            if vectors.shape[0] == len(self.docs):
                return vectors
        logger.info("embedding %d chunks with %s (cached in %s)", len(self.docs), self.embedder.name, path.parent)
        vectors = self.embedder.encode([f"{d.title}: {d.text}" for d in self.docs], progress=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, vectors)
        tmp.replace(path)  # concurrent replicas may build the same cache: the last rename wins, whole
        return vectors

    def build(self, vectors: Vectors) -> None:
        """Index the corpus's vectors; called once by `setup()`."""
        raise NotImplementedError

    def search(self, queries: Vectors, k: int) -> list[list[tuple[int, float]]]:
        """(document index, cosine similarity) pairs per query, best first."""
        raise NotImplementedError

    @make(batch=True, max_batch_size=64, read_only=True)
    def retrieve(self, query: list[str], topk: list[int | None] = None) -> list[list[Hit]]:  # type: ignore[assignment]
        """The best chunks for a query (a batch method: pipeline code calls `retrieve(query, topk=None)`).

        Args:
            query: the queries.
            topk: per query, how many hits (None: the retriever's `topk`).

        Returns:
            Each query's hits, best first.
        """
        # Called per question as retrieve(query, topk=None); `topk` left out is None per item: self.topk.
        k = max(t or self.topk for t in topk)
        if self.lexical:
            dense = self.search(self.embedder.encode(list(query)), max(k, FUSION_DEPTH))
            found = [self._fuse(ranked, q, k) for ranked, q in zip(dense, query)]
        else:
            found = self.search(self.embedder.encode(list(query)), k)
        return [
            [Hit(self.docs[i].id, self.docs[i].title, self.docs[i].text, round(score, 6)) for i, score in hits[: t or self.topk]]
            for hits, t in zip(found, topk)
        ]

    def _fuse(self, dense: list[tuple[int, float]], query: str, k: int) -> list[tuple[int, float]]:
        lexical = [self.positions[hit.id] for hit in self.bm25(query, max(k, FUSION_DEPTH))]
        scores: dict[int, float] = {}
        for ranking in ([i for i, _ in dense], lexical):
            for rank, i in enumerate(ranking, start=1):
                scores[i] = scores.get(i, 0.0) + 1.0 / (RRF_K + rank)
        return sorted(scores.items(), key=lambda item: (-item[1], item[0]))[:k]


class FaissRetriever(VectorRetriever):
    """FAISS on the CPU: `index="flat"` (exact) or `"ivf"` (inverted lists).

    Args:
        corpus: "pydoc" (the Python documentation this interpreter ships), a directory of text files, or a
            list of texts.
        topk: how many hits `retrieve` returns unless its call says otherwise.
        embedder: embeds the corpus (in `setup()`) and the queries (default: an `Embedder`).
        index: "flat" (exact) or "ivf" (inverted lists).
        nlist: with "ivf", its number of lists (default: about the square root of the chunks).
        nprobe: with "ivf", the lists a search visits.
        lexical: fuse the vector ranking with BM25's (see `VectorRetriever`).

    Raises:
        ValueError: an index that is neither "flat" nor "ivf".
    """

    def __init__(
        self,
        corpus: str | Sequence[str] = "pydoc",
        *,
        topk: int = 3,
        index: str = "flat",
        nlist: int | None = None,
        nprobe: int = 8,
        embedder: Embedder | None = None,
        lexical: bool = False,
    ) -> None:
        if index not in ("flat", "ivf"):
            raise ValueError(f"index must be 'flat' or 'ivf'; got {index!r}")
        super().__init__(corpus, topk=topk, embedder=embedder, lexical=lexical)
        self.index_kind, self.nlist, self.nprobe = index, nlist, nprobe

    def build(self, vectors: Vectors) -> None:
        """Index the corpus's vectors in FAISS; called once by `setup()`."""
        import faiss

        dim = vectors.shape[1]
        index: Any
        if self.index_kind == "flat":
            index = faiss.IndexFlatIP(dim)
        else:
            # FAISS wants about 39 training points per list.
            nlist = self.nlist or max(1, min(int(math.sqrt(len(vectors))), len(vectors) // 39))
            self._quantizer = faiss.IndexFlatIP(dim)  # kept alive here: the IVF index does not own it
            index = faiss.IndexIVFFlat(self._quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
            index.train(vectors)
            index.nprobe = min(self.nprobe, nlist)
        index.add(vectors)
        self.index = index

    def search(self, queries: Vectors, k: int) -> list[list[tuple[int, float]]]:
        """(document index, cosine similarity) pairs per query, best first, from FAISS."""
        scores, ids = self.index.search(queries, min(k, self.index.ntotal))
        return [[(int(i), float(s)) for i, s in zip(row_ids, row_scores) if i >= 0] for row_ids, row_scores in zip(ids, scores)]


class ChromaRetriever(VectorRetriever):
    """Chroma, embedded: persistent at `path`, or in memory; telemetry off, our own embeddings.

    Args:
        corpus: "pydoc" (the Python documentation this interpreter ships), a directory of text files, or a
            list of texts.
        topk: how many hits `retrieve` returns unless its call says otherwise.
        embedder: embeds the corpus (in `setup()`) and the queries (default: an `Embedder`).
        path: the directory Chroma keeps its collection in (None: in memory).
    """

    def __init__(
        self, corpus: str | Sequence[str] = "pydoc", *, topk: int = 3, path: str | None = None, embedder: Embedder | None = None
    ) -> None:
        super().__init__(corpus, topk=topk, embedder=embedder)
        self.path = path

    def build(self, vectors: Vectors) -> None:
        """Index the corpus's vectors in a Chroma collection; called once by `setup()`."""
        import chromadb
        from chromadb.config import Settings

        settings = Settings(anonymized_telemetry=False)
        client = chromadb.PersistentClient(self.path, settings=settings) if self.path else chromadb.EphemeralClient(settings)
        name = f"patchkit-{fingerprint(self.docs)}"
        collection = client.get_or_create_collection(name, embedding_function=None, metadata={"hnsw:space": "cosine"})
        if collection.count() != len(self.docs):
            for start in range(0, len(self.docs), 1000):
                part = slice(start, start + 1000)
                collection.upsert(ids=[str(i) for i in range(len(self.docs))[part]], embeddings=vectors[part])
        self.client, self.collection = client, collection

    def search(self, queries: Vectors, k: int) -> list[list[tuple[int, float]]]:
        """(document index, cosine similarity) pairs per query, best first, from a Chroma collection."""
        found = self.collection.query(query_embeddings=queries, n_results=min(k, len(self.docs)), include=["distances"])
        distances = found["distances"] or []
        return [[(int(i), 1.0 - float(d)) for i, d in zip(ids, dist)] for ids, dist in zip(found["ids"], distances)]


class QdrantRetriever(VectorRetriever):
    """Qdrant: local mode on disk at `path` or in memory (exact search in Python), or a server at `url`.

    Args:
        corpus: "pydoc" (the Python documentation this interpreter ships), a directory of text files, or a
            list of texts.
        topk: how many hits `retrieve` returns unless its call says otherwise.
        embedder: embeds the corpus (in `setup()`) and the queries (default: an `Embedder`).
        path: the directory of Qdrant's local mode (None, and no `url`: in memory).
        url: a Qdrant server's URL, instead of `path`.

    Raises:
        ValueError: both `path` and `url`.
    """

    def __init__(
        self,
        corpus: str | Sequence[str] = "pydoc",
        *,
        topk: int = 3,
        path: str | None = None,
        url: str | None = None,
        embedder: Embedder | None = None,
    ) -> None:
        if path and url:
            raise ValueError(f"give path ({path!r}) or url ({url!r}), not both")
        super().__init__(corpus, topk=topk, embedder=embedder)
        self.path, self.url = path, url

    def build(self, vectors: Vectors) -> None:
        """Index the corpus's vectors in a Qdrant collection; called once by `setup()`."""
        from qdrant_client import QdrantClient, models

        if self.url:
            # Its version check runs on a thread of its own and only warns; setup() reports a dead server below.
            client = QdrantClient(url=self.url, check_compatibility=False)
        else:
            client = QdrantClient(path=self.path) if self.path else QdrantClient(":memory:")
        name = f"patchkit-{fingerprint(self.docs)}"
        try:
            exists = client.collection_exists(name)
        except Exception as exc:  # a server's client raises its transport's own errors
            if not self.url:
                raise
            raise ConnectionError(
                f"cannot reach Qdrant at {self.url}: {type(exc).__name__}: {exc}; start the server there, "
                "or use QdrantRetriever(path=...) for local mode"
            ) from exc
        if not exists or client.count(name).count != len(self.docs):
            if client.collection_exists(name):
                client.delete_collection(name)
            params = models.VectorParams(size=vectors.shape[1], distance=models.Distance.COSINE)
            client.create_collection(name, vectors_config=params)
            client.upload_collection(name, vectors=vectors, ids=list(range(len(self.docs))))
        self.client, self.name = client, name

    def search(self, queries: Vectors, k: int) -> list[list[tuple[int, float]]]:
        """(document index, cosine similarity) pairs per query, best first, from a Qdrant collection."""
        from qdrant_client import models

        requests = [models.QueryRequest(query=q.tolist(), limit=k) for q in queries]
        found = self.client.query_batch_points(self.name, requests)
        return [[(int(p.id), float(p.score)) for p in result.points] for result in found]

