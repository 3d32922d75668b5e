"""Issue 18: code users write around and inside a capture, compared with plain Python eagerly and
deployed, and the two constructs refused with a CaptureError that names the fix.

The corpus cases of `corpus.FIDELITY` run through every corpus test (eagerly in
test_capture_corpus.py, deployed inprocess in test_frontend.py, on workers in test_deploy_local.py);
the tests here check what each class adds: no stray inputs, objects bound by identity, components
that get workers whether or not the capture run called them, and the error texts.
"""

from __future__ import annotations

import json
import re
from typing import Any

import cloudpickle
import pytest
from conftest import load_source
from corpus import FIDELITY
from test_capture_corpus import _capture, _reference

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


# -- 2. components held by `self`, a pipeline called inside another --------------------------------
SELF_SOURCE = """
class Counting(patchkit.Component):
    setups = 0
    def setup(self):
        Counting.setups += 1
    @patchkit.make
    def tag(self, text):
        return "<" + text + ">"
class Assistant:
    def __init__(self):
        self.tagger = Counting()
        self.runs = 0
    def answer(self, query):
        with patchkit.capture():
            self.runs += 1
            return self.tagger.tag(query)
assistant = Assistant()
def run(query):
    return assistant.answer(query)
"""


def test_self_is_bound_by_identity_and_never_copied() -> None:
    namespace = load_source(SELF_SOURCE, "<self>")
    namespace["run"](QUERY)
    pipeline = patchkit.last_pipeline()
    assert pipeline.inputs == {"query": QUERY}
    assert [pipeline(query=q) for q in OTHERS] == [f"<{q}>" for q in OTHERS]
    assert namespace["assistant"].runs == 1 + len(OTHERS)  # the same object ran every time
    assert namespace["Counting"].setups == 1  # its component was not rebuilt per run


def test_components_held_by_self_are_the_pipelines() -> None:
    pipeline, _ = _capture(CASE["method_reads_components_through_self"])
    assert pipeline.inputs == {"query": "How do I catch an exception?"}
    assert set(pipeline.components) == {"retriever", "llm"}
    assert {n.label for n in pipeline.graph.nodes.values()} == {"retriever.retrieve", "llm.generate"}


def test_a_pipeline_called_inside_a_capture_is_bound_and_its_calls_are_the_outer_ones() -> None:
    case = CASE["pipeline_called_inside_capture"]
    pipeline, namespace = _capture(case)
    assert pipeline.inputs == {"query": "How do I catch an exception?"}
    assert set(pipeline.components) == {"retriever", "grader", "llm"}
    assert namespace["retriever"].loads == 1
    for inputs in case.inputs:
        assert pipeline(**inputs) == _reference(case, inputs)
    # the inner pipeline's calls were counted where they were made: in the outer pipeline
    assert {n.label for n in pipeline.graph.nodes.values()} >= {"retriever.retrieve", "grader.grade", "llm.generate"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["method_reads_components_through_self", "pipeline_called_inside_capture"])
def test_components_reached_through_objects_are_served_by_their_workers(name: str) -> None:
    case = CASE[name]
    pipeline, _ = _capture(case)
    query = {"query": "What is a generator?"}
    expected = json.loads(json.dumps(_reference(case, query)))
    with patchkit.deploy(pipeline, backend="local") as endpoint:
        assert endpoint.query(**query) == expected
        calls = _calls(endpoint)
    assert calls["retriever"] == {"retrieve": 1}
    assert calls["llm"] == {"generate": 1}


# -- 3. zero-argument super() -----------------------------------------------------------------------
def test_super_works_in_every_run_of_every_rebuilt_function() -> None:
    case = CASE["zero_argument_super"]
    pipeline, _ = _capture(case)
    copy = cloudpickle.loads(cloudpickle.dumps(pipeline))  # a new function, as in a new front-end
    for inputs in case.inputs + case.inputs:
        expected = _reference(case, inputs)
        assert copy(**inputs) == expected
        assert pipeline(**inputs) == expected
    assert pipeline.inputs == {"query": "How do I catch an exception?"}


# -- 4. components in containers, on a path the capture run does not take ---------------------------
def test_components_in_containers_are_registered_though_never_called() -> None:
    pipeline, namespace = _capture(CASE["components_in_containers"])
    assert pipeline.inputs == {"query": "How do I catch an exception?"}
    assert pipeline.components == {"docs": namespace["retriever"], "words": namespace["llm2"], "judges_0": namespace["grader"]}


@pytest.mark.slow
def test_a_container_component_on_a_path_not_taken_runs_on_its_worker() -> None:
    case = CASE["components_in_containers"]
    pipeline, _ = _capture(case)  # the capture run takes the "docs" path
    query = {"query": "Tell me about nothing in particular"}
    expected = json.loads(json.dumps(_reference(case, query)))
    with patchkit.deploy(pipeline, backend="local") as endpoint:
        assert endpoint.query(**query) == expected
        calls = _calls(endpoint)
    assert calls["words"] == {"generate": 1}
    assert calls["judges_0"] == {"score": 1}


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


# -- 6. a helper defined before the block reading a variable of the block ---------------------------
def test_a_module_helper_reading_an_input_as_a_global_is_refused() -> None:
    source = "def helper(docs):\n    return llm.generate(query, docs)\n\nquery = 'q'\nwith patchkit.capture():\n" \
        "    found = retriever.retrieve(query)\n    answer = helper(found)\n"
    message = (
        "<cell>:7: cannot capture the helper `helper` (<cell>:1), which reads `query` as a global. In a pipeline it "
        "would see the value `query` had at capture, not the request's. Pass it as an argument: "
        "`def helper(query, ...)`, called as `helper(query, ...)` in the block."
    )
    with pytest.raises(CaptureError, match=re.escape(message)):
        load_source(source, "<cell>")
    # the fix the message names: the helper takes the input as an argument
    source = source.replace("def helper(docs)", "def helper(query, docs)").replace("helper(found)", "helper(query, found)")
    source = source.replace("query = 'q'\n", "")
    namespace = load_source(source, "<cell>", extra={"query": QUERY})
    pipeline = patchkit.last_pipeline()
    expected = [load_source(source, "<ref>", extra={"query": q})["answer"] for q in OTHERS]
    assert [pipeline(query=q) for q in OTHERS] == expected
    assert pipeline() == namespace["answer"]
    with patchkit.deploy(pipeline, backend="inprocess") as endpoint:
        assert [endpoint.query(query=q) for q in OTHERS] == expected


def test_a_helper_reading_a_name_the_block_assigns_through_another_helper_is_refused() -> None:
    source = "def inner():\n    return docs\ndef outer():\n    return inner()\n\nwith patchkit.capture():\n" \
        "    docs = retriever.retrieve('loops')\n    answer = outer()\n"
    with pytest.raises(CaptureError, match=r"<cell>:8: cannot capture the helper `inner` \(<cell>:1, called through `outer`\)"):
        load_source(source, "<cell>")


def test_a_closure_reading_an_input_of_a_function_block_is_refused() -> None:
    source = "def run(query):\n    def helper(docs):\n        return llm.generate(query, docs)\n" \
        "    with patchkit.capture():\n        return helper(retriever.retrieve(query))\n"
    with pytest.raises(CaptureError, match=re.escape("<fn>:5: cannot capture the helper `helper` (<fn>:2), which reads "
                                                     "`query` through its closure.")):
        load_source(source, "<fn>")["run"](QUERY)
