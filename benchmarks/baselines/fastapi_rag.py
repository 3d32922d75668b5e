"""The RAG server a competent user writes without patchkit: FastAPI, uvicorn, the plain libraries.

    python -m benchmarks.baselines.fastapi_rag --port 8000 --topk 3 --max-tokens 64

Retrieve-then-answer over the pydoc corpus, as `benchmarks/rag_stream.py`'s plain pipeline does and
with its prompt: MiniLM through sentence-transformers, a FAISS flat inner-product index, then
SmolLM2-135M-Instruct through llama-cpp-python's `Llama` (greedy). The server is written the way the
libraries' own documentation leads:

- sync handlers (`def`), which FastAPI runs on its thread pool, so requests overlap;
- one `Llama` engine per core, each of one thread, handed out by a `queue.Queue`: a request takes an
  engine for its answer and gives it back, so every core answers a question while others wait;
- each engine keeps the prompt prefix it evaluated last (llama-cpp-python does that by itself), and with
  `--ram-cache` a `LlamaRAMCache` too, which restores the KV state of an earlier prompt sharing the new
  one's prefix (the system prompt and the documents, when a popular module is asked about again);
- the embedder and FAISS on one thread each: a question is one short sentence, and torch's own pool
  on every core would fight the engines for them.

It speaks patchkit's HTTP API (`POST /v1/query {"inputs": {"question": ...}, "stream"?: bool}` ->
`{"output": {"answer", "documents"}}`, or a `text/event-stream` of `data: {"delta": ...}` then
`data: {"output": ...}`; `GET /healthz`), so one load generator drives both. Prints `READY <url>` on
stdout once it answers. Every llama.cpp model opens through patchkit's `open_llama`, which turns off
the weight repacking that crashes llama.cpp on CPUs with AMX (the only part of patchkit it uses,
besides the corpus, the model paths and the cache directory where the corpus's embeddings are kept
once computed, as an index is built ahead of serving).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is on disk: nothing downloads at run time
os.environ.setdefault("OMP_NUM_THREADS", "1")

import faiss  # noqa: E402
import numpy as np  # noqa: E402
import uvicorn  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402
from pydantic import BaseModel  # noqa: E402

from patchkit.components.documents import Document, pydoc_corpus  # noqa: E402
from patchkit.components.embedder import default_model_path  # noqa: E402
from patchkit.components.generators.base import DEFAULT_SYSTEM_PROMPT, default_gguf_path  # noqa: E402
from patchkit.components.generators.llama.loading import open_llama  # noqa: E402
from patchkit.envs import cache_dir  # noqa: E402


def messages(question: str, docs: Sequence[Document]) -> list[dict[str, str]]:
    """The chat: the documents numbered, then the question (LlamaCppGenerator's prompt, checked by rag_stream)."""
    context = "\n".join(f"[{i}] {doc.title}: {doc.text}" for i, doc in enumerate(docs, 1))
    user = f"Documents:\n{context}\n\nAnswer the question using the documents.\n\nQuestion: {question}"
    return [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": user}]


class Retriever:
    """MiniLM embeddings of the corpus in a FAISS flat inner-product index."""

    def __init__(self, topk: int) -> None:
        import torch
        from sentence_transformers import SentenceTransformer

        torch.set_num_threads(1)
        faiss.omp_set_num_threads(1)
        self.docs, self.topk = pydoc_corpus(), topk
        self.model = SentenceTransformer(str(default_model_path()), device="cpu", local_files_only=True)
        vectors = self.corpus_vectors()
        self.index = faiss.IndexFlatIP(vectors.shape[1])
        self.index.add(vectors)

    def corpus_vectors(self) -> np.ndarray:
        """The corpus's embeddings, computed once and kept on disk, as an index is built offline."""
        texts = [f"{doc.title}: {doc.text}" for doc in self.docs]
        key = hashlib.sha256("\0".join([str(default_model_path()), *texts]).encode()).hexdigest()[:16]
        path = cache_dir() / f"fastapi-rag-{key}.npy"
        if path.exists():
            return np.load(path)
        vectors = self.embed(texts)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, vectors)
        return vectors

    def embed(self, texts: list[str]) -> np.ndarray:
        vectors = self.model.encode(texts, batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def __call__(self, question: str) -> list[Document]:
        _, ids = self.index.search(self.embed([question]), self.topk)
        return [self.docs[i] for i in ids[0] if i >= 0]


class EnginePool:
    """One single-thread `Llama` per core; `take()` lends one for a whole answer."""

    def __init__(self, engines: int, n_ctx: int, ram_cache_bytes: int) -> None:
        from llama_cpp import LlamaRAMCache

        self.free: queue.Queue[Any] = queue.Queue()
        for _ in range(engines):
            llm = open_llama(str(default_gguf_path()), n_ctx=n_ctx, n_threads=1, n_threads_batch=1, verbose=False)
            if ram_cache_bytes:
                llm.set_cache(LlamaRAMCache(capacity_bytes=ram_cache_bytes))
            self.free.put(llm)

    @contextmanager
    def take(self) -> Iterator[Any]:
        llm = self.free.get()
        try:
            yield llm
        finally:
            self.free.put(llm)


class Query(BaseModel):
    inputs: dict[str, str]
    stream: bool = False


def build_app(retrieve: Retriever, engines: EnginePool, max_tokens: int) -> FastAPI:
    app = FastAPI()

    def answer(question: str, docs: list[Document]) -> Any:
        with engines.take() as llm:
            chat: Any = messages(question, docs)
            return llm.create_chat_completion(messages=chat, max_tokens=max_tokens, temperature=0.0, seed=0)

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/query", response_model=None)
    def query(body: Query) -> dict[str, Any] | StreamingResponse:
        question = body.inputs["question"]
        docs = retrieve(question)
        ids = [doc.id for doc in docs]
        if not body.stream:
            reply = answer(question, docs)
            return {"output": {"answer": reply["choices"][0]["message"]["content"].strip(), "documents": ids}}

        def events() -> Iterator[str]:  # starlette iterates a sync generator on its thread pool
            with engines.take() as llm:
                chat: Any = messages(question, docs)
                parts = []
                for chunk in llm.create_chat_completion(messages=chat, max_tokens=max_tokens, temperature=0.0, seed=0,
                                                        stream=True):
                    if delta := chunk["choices"][0]["delta"].get("content"):
                        parts.append(delta)
                        yield f"data: {json.dumps({'delta': delta})}\n\n"
            yield f"data: {json.dumps({'output': {'answer': ''.join(parts).strip(), 'documents': ids}})}\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--engines", type=int, default=len(os.sched_getaffinity(0)), help="default: one per core")
    parser.add_argument("--ram-cache", type=int, default=0, help="LlamaRAMCache bytes per engine (0: none)")
    args = parser.parse_args()
    app = build_app(Retriever(args.topk), EnginePool(args.engines, args.n_ctx, args.ram_cache), args.max_tokens)
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    print(f"READY http://127.0.0.1:{args.port}", flush=True)  # the app is built; uvicorn binds next
    sys.stdout.flush()
    server.run()


if __name__ == "__main__":
    main()
