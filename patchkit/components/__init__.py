"""Built-in components.

An embedder, document loaders, retrievers over FAISS, Chroma and Qdrant, a hybrid CPU/GPU IVF retriever, generators over
llama.cpp, transformers, vLLM and OpenAI-compatible servers, and a speculative retriever for iterative pipelines.

They know only `Component` and `make`; their heavy libraries load in `setup()`, in the process that
runs them. Install them with `pip install -e '.[retrieval,llm]'` in patchkit's checkout.
"""

from patchkit.components.blocks import Augmenter, BM25Search, Grader, Rewriter, WebSearch
from patchkit.components.documents import Document, Hit, from_directory, from_texts, merge_hits, pydoc_corpus, sources
from patchkit.components.embedder import Embedder
from patchkit.components.generators import Generator, LlamaCppGenerator, OpenAIGenerator, TransformersGenerator, VLLMGenerator
from patchkit.components.hybrid import HybridIVFRetriever
from patchkit.components.retrievers import ChromaRetriever, FaissRetriever, QdrantRetriever, VectorRetriever
from patchkit.components.speculative import SpeculativeRetriever, SpeculativeState

__all__ = [
    "Augmenter",
    "BM25Search",
    "Grader",
    "Rewriter",
    "WebSearch",  # the former name of BM25Search: warns when made
    "ChromaRetriever",
    "Document",
    "Embedder",
    "FaissRetriever",
    "Hit",
    "HybridIVFRetriever",
    "Generator",
    "LlamaCppGenerator",
    "OpenAIGenerator",
    "TransformersGenerator",
    "VLLMGenerator",
    "QdrantRetriever",
    "SpeculativeRetriever",
    "SpeculativeState",
    "VectorRetriever",
    "from_directory",
    "from_texts",
    "merge_hits",
    "pydoc_corpus",
    "sources",
]
