"""`patchkit demo` finds what it is asked: its retriever's recall on labelled standard-library questions,
and the sources its CRAG pipeline shows for its own questions (benchmarks/recall.py measures both)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("sentence_transformers", reason="the Embedder needs sentence-transformers: pip install -e '.[retrieval]'")
pytest.importorskip("faiss", reason="the retrievers search FAISS indexes: pip install -e '.[retrieval]'")
pytest.importorskip("llama_cpp", reason="the demo's pipeline answers with llama.cpp: pip install -e '.[llm]'")

pytestmark = pytest.mark.slow

BENCHMARK = Path(__file__).parents[1] / "benchmarks" / "recall.py"


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A fresh cache: the index is built from the corpus as a new user's first run builds it."""
    monkey = pytest.MonkeyPatch()
    monkey.setenv("PATCHKIT_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    yield
    monkey.undo()


@pytest.fixture(scope="module")
def recall() -> ModuleType:
    spec = importlib.util.spec_from_file_location("recall_benchmark", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_set_labels_the_questions_the_demo_asks(recall: ModuleType) -> None:
    from patchkit.examples import crag

    labelled = recall.load_questions(recall.SETS["demo"])
    assert [item["question"] for item in labelled] == list(crag.QUESTIONS)
    assert all(item["answers"] for item in labelled)


def test_the_demo_retriever_finds_the_answering_document_of_every_demo_question(recall: ModuleType) -> None:
    result = recall.evaluate(recall.demo_retriever(), recall.load_questions(recall.SETS["demo"]))
    assert result["misses"] == []


@pytest.mark.parametrize(("name", "least"), [("labelled", 0.9), ("fresh", 0.7)])
def test_the_demo_retriever_finds_the_answering_module_in_its_top_3(recall: ModuleType, name: str, least: float) -> None:
    questions = recall.load_questions(recall.SETS[name])
    assert len(questions) == 20
    result = recall.evaluate(recall.demo_retriever(), questions)
    assert result["recall@3"] >= least, result["misses"]


def test_the_demo_shows_answering_sources_even_where_its_grader_rejects_them(recall: ModuleType) -> None:
    # SmolLM2-135M's grader rejects documents that answer, and its rewrites are answers rather than
    # queries: where it rejects, the documents found stay and the fallback's are added.
    result = recall.evaluate_pipeline(recall.load_questions(recall.SETS["demo"]))
    assert result["right"] == 8, [row for row in result["shown"] if not row["right"]]
