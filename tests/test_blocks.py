"""RAG building blocks: augmentation, yes/no parsing, BM25 search, and the LLM grader and rewriter on SmolLM2."""

from __future__ import annotations

import pytest

from patchkit import components
from patchkit.components.blocks import Augmenter, BM25Index, BM25Search, WebSearch, parse_yes_no
from patchkit.components.documents import Hit, from_texts


def test_augmenter_puts_documents_into_the_template() -> None:
    augmenter = Augmenter("Q: {question}\n{context}")
    assert augmenter.augment("why?", ["because", "just so"]) == "Q: why?\n[1] because\n[2] just so"
    with pytest.raises(ValueError, match="must contain {context}"):
        Augmenter("{question} only")


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [("Yes.", True), ("yes, they do", True), ("No", False), ("  NO - not relevant", False),
     ("The documents are relevant.", True), ("They are not helpful", False), ("Maybe?", None), ("", None),
     ("Irrelevant.", False), ("Correct", True), ("Nonetheless, yes", True), ("1. Yes.", True)],
)
def test_yes_no_parsing_takes_the_first_verdict_word(reply: str, verdict: bool | None) -> None:
    assert parse_yes_no(reply) is verdict


def test_the_index_ranks_by_bm25() -> None:
    search = BM25Index(from_texts(["cats purr and sleep", "dogs bark", "cats and dogs and cats"]))
    hits = search("cats", 2)
    assert [h.text for h in hits] == ["cats and dogs and cats", "cats purr and sleep"]
    assert hits[0].score > hits[1].score > 0 and hits[0].id == "text2#0"
    assert search("zebra", 3) == []


@pytest.mark.slow
def test_bm25_search_is_offline_over_module_docstrings() -> None:
    results = BM25Search(topk=2).search("encode and decode JSON data")
    assert len(results) == 2 and results[0].title == "json" and results[0].id.startswith("module:json")
    custom = BM25Search(backend=lambda query, topk: [f"result for {query}"] * topk, topk=1)
    assert custom.search("x") == ["result for x"]


def test_web_search_is_the_former_name_and_warns_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(WebSearch, "_warned", False)
    with pytest.warns(DeprecationWarning, match="WebSearch is now BM25Search; it searches local documents, not the web"):
        old = WebSearch(topk=1)
    assert isinstance(old, BM25Search) and old.topk == 1 and components.WebSearch is WebSearch
    assert WebSearch(backend=lambda query, topk: [query], topk=2).search("x") == ["x"]  # warnings are errors here


@pytest.mark.slow
def test_grader_verdicts_and_rewriter_use_a_real_model() -> None:
    pytest.importorskip("llama_cpp", reason="the grader asks SmolLM2 through llama.cpp: pip install -e '.[llm]'")
    from patchkit.components.blocks import Grader, Rewriter
    from patchkit.components.generators import LlamaCppGenerator

    llm = LlamaCppGenerator(threads=1)
    grader, rewriter = Grader(llm), Rewriter(llm)
    assert grader.grade("How do I catch an exception?", []) is False
    # Each document's score points the other way, so a verdict that passes is the model's yes or no,
    # not the fallback for a reply with neither. SmolLM2-135M grades near chance on most inputs: these
    # are ones it answers right, deterministically at temperature 0 (with 1 or 2 threads alike).
    helpful = Hit("topic:try#0", "try", "Use try and except to catch an exception in Python.", 0.0)
    assert grader.grade("How do I catch an exception in Python?", [helpful]) is True
    unrelated = Hit("module:paris#0", "paris", "The Eiffel Tower is in Paris.", 1.0)
    assert grader.grade("Does Python catch exceptions with try and except?", [unrelated]) is False
    query = rewriter.rewrite("How do I catch an exception in Python?")
    assert isinstance(query, str) and query and "\n" not in query
