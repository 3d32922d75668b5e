"""The default retriever answers right: recall@3 >= 0.9 on the labelled standard-library questions."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sentence_transformers", reason="the Embedder needs sentence-transformers: pip install -e '.[retrieval]'")
pytest.importorskip("faiss", reason="the retrievers search FAISS indexes: pip install -e '.[retrieval]'")

from patchkit.components import FaissRetriever  # noqa: E402

pytestmark = pytest.mark.slow

BENCHMARK = Path(__file__).parents[1] / "benchmarks" / "recall.py"


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    monkey = pytest.MonkeyPatch()
    monkey.setenv("PATCHKIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield
    monkey.undo()


def test_the_pydoc_retriever_finds_the_answering_module_in_its_top_3() -> None:
    spec = importlib.util.spec_from_file_location("recall_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    recall = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recall)
    questions = recall.load_questions()
    assert len(questions) == 20
    result = recall.evaluate(FaissRetriever("pydoc", topk=3), questions)
    assert result["recall@3"] >= 0.9, result["misses"]
