"""Issue 18: code users write around and inside a capture, compared with plain Python eagerly and
deployed, and the two constructs refused with a CaptureError that names the fix.

The corpus cases of `corpus.FIDELITY` run through every corpus test (eagerly in
test_capture_corpus.py, deployed inprocess in test_frontend.py, on workers in test_deploy_local.py);
the tests here check what each class adds: no stray inputs, objects bound by identity, components
that get workers whether or not the capture run called them, and the error texts.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
from conftest import load_source
from corpus import FIDELITY
from test_capture_corpus import _capture

import patchkit
from patchkit import CaptureError

CASE = {case.name: case for case in FIDELITY}
QUERY = "What is a generator?"
OTHERS = ["How do I catch an exception?", "Tell me about nothing in particular", "loops"]


def _calls(endpoint: patchkit.Endpoint) -> dict[str, dict[str, int]]:
    """Calls each worker served, per component and method."""
    components = endpoint.stats()["components"]
    return {name: {m: s["calls"] for m, s in c["methods"].items() if s["calls"]} for name, c in components.items()}


def _answers_like_python(source: str, name: str, queries: list[str], **extra: Any) -> patchkit.Pipeline:
    """Capture `run(QUERY)` of `source`; its answers on `queries` equal plain Python's."""
    namespace = load_source(source, f"<{name}>")
    namespace["run"](QUERY, **extra)
    pipeline = patchkit.last_pipeline()
    for query in queries:
        assert pipeline(query=query) == load_source(source, f"<{name} reference>")["run"](query, **extra), query
    return pipeline


# -- 1. a capture inside another statement ---------------------------------------------------------
def test_variables_of_an_outer_finally_are_not_inputs() -> None:
    pipeline, _ = _capture(CASE["capture_inside_try_finally"])
    assert pipeline.inputs == {"query": "How do I catch an exception?"}


@pytest.mark.parametrize("around", ["with span():", "with contextlib.nullcontext(), span():", "try:"])
def test_returns_inside_a_capture_inside_another_statement(around: str) -> None:
    after = "    finally:\n        seen.append('finally')\n" if around == "try:" else ""
    source = f"""
import contextlib
seen = []
class span:
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        seen.append("exit")
def run(query):
    {around}
        with patchkit.capture():
            docs = retriever.retrieve(query)
            if not docs:
                return "no documents"
            if len(docs) == 1:
                return llm.generate(query, docs)
            return 2
{after}"""
    pipeline = _answers_like_python(source, "around", [*OTHERS, "zzz"])
    assert pipeline.inputs == {"query": QUERY} and pipeline.output == "return"


def test_a_capture_inside_another_statement_deploys_with_its_own_inputs_only() -> None:
    pipeline, _ = _capture(CASE["capture_inside_try_finally"])
    expected = [pipeline(query=q) for q in OTHERS]
    with patchkit.deploy(pipeline, backend="inprocess") as endpoint:  # every input is required
        assert [endpoint.query(query=q) for q in OTHERS] == expected


# -- 5. a block that returns on one path and ends on another ----------------------------------------
MIXED = """
def run(query):
    log = []
    with patchkit.capture({output}):
        docs = retriever.retrieve(query)
        if not docs:
            return "no documents"
        answer = llm.generate(query, docs)
    log.append(answer)
    return answer
"""


def test_a_return_on_one_path_and_code_after_the_block_on_another_is_refused_until_output_is_named() -> None:
    message = (
        "<mixed>:4: cannot capture a block that returns on one path (line 7) and ends without `return` on another "
        "(line 8). Name the variable a path without `return` gives: `with patchkit.capture(output='answer'):`, or end "
        "every path with `return`."
    )
    with pytest.raises(CaptureError, match=re.escape(message)):
        load_source(MIXED.format(output=""), "<mixed>")["run"](QUERY)
    # the fix the message names: the paths without `return` give `answer`, eagerly and deployed
    pipeline = _answers_like_python(MIXED.format(output="output='answer'"), "mixed", [*OTHERS, "zzz"])
    assert pipeline.output == "answer"
    expected = [pipeline(query=q) for q in [*OTHERS, "zzz"]]
    assert "no documents" in expected
    with patchkit.deploy(pipeline, backend="inprocess") as endpoint:
        assert [endpoint.query(query=q) for q in [*OTHERS, "zzz"]] == expected


def test_a_return_right_after_the_block_or_the_functions_end_is_the_paths_answer() -> None:
    pipeline, _ = _capture(CASE["return_in_block_and_after_it"])
    assert pipeline.output == "return"
    assert pipeline(query="zzz") == "no documents"
    assert pipeline(query="loops") == "A: loops for and while loops repeat"
    # A block that ends its function: a path without `return` gives None, as calling the function does.
    source = "def run(query):\n    with patchkit.capture():\n        if grader.score(query) == 0:\n" \
        "            return llm.generate(query)\n        note = 'nothing returned'\n"
    _answers_like_python(source, "end", ["a", "b", "c", "d", "e", "f", "g"])
