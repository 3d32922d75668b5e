"""Inputs for a method the calibration never reached, taken from recorded calls it can take (`stand_ins`).

The planner end to end (a branch the calibration leaves untaken, planned with the inputs the capture
recorded) is in test_planner.py; here, which recorded calls fit which method, on the corpus components.
"""

from __future__ import annotations

from typing import Any

from components import Generator, Grader, Retriever, Slow

from patchkit.capture.recorder import CallRecord
from patchkit.core import Component
from patchkit.scheduler.offline.stand_ins import stand_in

RETRIEVER, GRADER, REWRITER, SLOW = Retriever(), Grader(), Generator("R"), Slow()
NAMES = {c._patchkit_spec.uid: name for name, c in
         (("retriever", RETRIEVER), ("grader", GRADER), ("rewriter", REWRITER), ("slow", SLOW))}


def record(component: Component, method: str, *args: Any, **kwargs: Any) -> CallRecord:
    return CallRecord(component, method, args, kwargs, None, 0.01, None)


def test_its_own_recorded_calls_come_first_distinct_and_in_order() -> None:
    records = [record(RETRIEVER, "retrieve", "What is a list?"), record(REWRITER, "rewrite", "how to loop"),
               record(REWRITER, "rewrite", "how to loop"), record(REWRITER, "rewrite", query="what is a set")]
    found = stand_in(REWRITER, "rewriter", "rewrite", records, NAMES)
    assert found is not None and found.source.startswith("its own calls recorded before the calibration")
    assert found.calls == [(("how to loop",), {}), ((), {"query": "what is a set"})]


def test_a_method_with_the_same_parameters_lends_its_inputs_by_name() -> None:
    # Generator.rewrite(query: list[str]) and Retriever.retrieve(query: list[str]), both batched: one query: str each
    records = [record(GRADER, "grade", "What is a list?", []), record(RETRIEVER, "retrieve", "What is a list?"),
               record(RETRIEVER, "retrieve", query="What is a tuple?")]
    found = stand_in(REWRITER, "rewriter", "rewrite", records, NAMES)
    assert found is not None
    assert found.source == "the inputs of retriever.retrieve, whose parameters are the same (query: str)"
    assert found.calls == [((), {"query": "What is a list?"}), ((), {"query": "What is a tuple?"})]


def test_same_names_are_preferred_then_same_types_under_other_names() -> None:
    # Slow.echo(text: str): Grader.score(text: str) has its parameter; Retriever.retrieve(query: str) only its type
    retrieved, scored = record(RETRIEVER, "retrieve", "What is a list?"), record(GRADER, "score", "a text")
    found = stand_in(SLOW, "slow", "echo", [retrieved, scored], NAMES)
    assert found is not None and found.source.startswith("the inputs of grader.score, whose parameters are the same")
    found = stand_in(SLOW, "slow", "echo", [retrieved], NAMES)
    assert found is not None
    assert found.source == "the inputs of retriever.retrieve, whose parameters have the same types (query: str)"
    assert found.calls == [((), {"text": "What is a list?"})]


def test_no_recorded_call_that_fits_is_none() -> None:
    # Grader.grade(query: str, docs: list[str]) takes two; a value of another type than its annotation does not fit
    records = [record(RETRIEVER, "retrieve", "What is a list?"), record(SLOW, "echo", 42)]
    assert stand_in(GRADER, "grader", "grade", records, NAMES) is None
    assert stand_in(GRADER, "grader", "score", [record(SLOW, "echo", 42)], NAMES) is None
