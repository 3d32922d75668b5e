"""Every corpus pipeline, re-run on new inputs, answers exactly as plain Python does."""

from __future__ import annotations

import pytest
from conftest import load_source
from corpus import CASES, Case

import patchkit


def _capture(case: Case) -> tuple[patchkit.Pipeline, dict]:
    first = case.inputs[0]
    if case.kind == "function":
        namespace = load_source(case.source, f"<corpus {case.name}>")
        namespace["run"](**first)
    else:
        namespace = load_source(case.source, f"<corpus {case.name}>", extra=first)
    return patchkit.last_pipeline(), namespace


def _reference(case: Case, inputs: dict) -> object:
    """The same code run as plain Python, on fresh components."""
    if case.kind == "function":
        return load_source(case.source, f"<reference {case.name}>")["run"](**inputs)
    return load_source(case.source, f"<reference {case.name}>", extra=inputs)[case.output or "answer"]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_captured_pipeline_answers_like_python(case: Case) -> None:
    pipeline, _ = _capture(case)
    for inputs in case.inputs:
        assert pipeline(**inputs) == _reference(case, inputs), inputs


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_graph_finds_the_calls_and_counts_visits(case: Case) -> None:
    pipeline, _ = _capture(case)
    static = {n.label for n in pipeline.graph.nodes.values()}
    assert case.calls <= static
    for inputs in case.inputs[1:]:
        pipeline(**inputs)
    recorded = len(pipeline.recorded)
    assert sum(n.visits for n in pipeline.graph.nodes.values()) == recorded
    assert pipeline.graph.runs == len(case.inputs)


@pytest.mark.parametrize("case", [c for c in CASES if c.exact_inputs or c.components], ids=lambda c: c.name)
def test_inputs_and_components_are_the_cases(case: Case) -> None:
    """No name of the code around the block becomes an input; every component held is registered."""
    pipeline, _ = _capture(case)
    if case.exact_inputs:
        assert set(pipeline.inputs) == set(case.inputs[0])
    assert case.components <= set(pipeline.components)


def test_corpus_is_large_enough() -> None:
    assert len(CASES) >= 25


def test_inputs_are_names_bound_before_the_block() -> None:
    namespace = load_source(CASES[0].source, "<inputs>")
    namespace["run"]("What is a generator?")
    pipeline = patchkit.last_pipeline()
    assert pipeline.inputs == {"query": "What is a generator?"}
    assert pipeline.output == "return"
    assert set(pipeline.components) == {"retriever", "grader", "llm"}


def test_module_block_defaults_to_last_assigned_name() -> None:
    case = next(c for c in CASES if c.name == "module_default_output")
    pipeline, namespace = _capture(case)
    assert pipeline.output == "answer"
    assert pipeline.inputs == {"query": case.inputs[0]["query"]}  # docs is written before it is read
    assert pipeline() == namespace["answer"]
