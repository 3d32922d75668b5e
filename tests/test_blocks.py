"""RAG building blocks: augmentation, yes/no parsing, and the LLM grader and rewriter on SmolLM2."""

from __future__ import annotations

import pytest

from patchkit.components.blocks import Augmenter, KeywordSearch, WebSearch, parse_yes_no
from patchkit.components.documents import from_texts


def test_augmenter_puts_documents_into_the_template() -> None:
    augmenter = Augmenter("Q: {question}\n{context}")
    assert augmenter.augment("why?", ["because", "just so"]) == "Q: why?\n[1] because\n[2] just so"
    with pytest.raises(ValueError, match="must contain {context}"):
        Augmenter("{question} only")


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [("Yes.", True), ("yes, they do", True), ("No", False), ("  NO - not relevant", False),
     ("The documents are relevant.", True), ("They are not helpful", False), ("Maybe?", None), ("", None)],
)
def test_yes_no_parsing_takes_the_first_verdict_word(reply: str, verdict: bool | None) -> None:
    assert parse_yes_no(reply) is verdict


def test_keyword_search_ranks_by_bm25() -> None:
    search = KeywordSearch(from_texts(["cats purr and sleep", "dogs bark", "cats and dogs and cats"]))
    hits = search("cats", 2)
    assert [h.text for h in hits] == ["cats and dogs and cats", "cats purr and sleep"]
    assert hits[0].score > hits[1].score > 0 and hits[0].id == "text2#0"
    assert search("zebra", 3) == []


@pytest.mark.slow
def test_web_search_is_offline_over_module_docstrings() -> None:
    results = WebSearch(topk=2).search("encode and decode JSON data")
    assert len(results) == 2 and results[0].title == "json" and results[0].id.startswith("module:json")
    custom = WebSearch(backend=lambda query, topk: [f"result for {query}"] * topk, topk=1)
    assert custom.search("x") == ["result for x"]


@pytest.mark.slow
def test_grader_and_rewriter_use_a_real_model() -> None:
    pytest.importorskip("llama_cpp")
    from patchkit.components.blocks import Grader, Rewriter
    from patchkit.components.generators import LlamaCppGenerator

    llm = LlamaCppGenerator(threads=1)
    grader, rewriter = Grader(llm), Rewriter(llm)
    assert grader.grade("How do I catch an exception?", []) is False
    verdict = grader.grade("How do I catch an exception?", ["Use try and except to catch an exception."])
    assert isinstance(verdict, bool)
    query = rewriter.rewrite("How do I catch an exception in Python?")
    assert isinstance(query, str) and query and "\n" not in query
