"""capture(): inputs, outputs, run=False, caching, errors a user can act on."""

from __future__ import annotations

import sys

import pytest
from conftest import load_source

import patchkit
from patchkit import CaptureError, InputError
from patchkit.client import capture as capture_module


def test_run_false_skips_the_body_and_still_captures() -> None:
    ns = load_source(
        """
query = "What is a generator?"
ran = []
with patchkit.capture(run=False) as pipeline:
    ran.append(1)
    answer = llm.generate(query, retriever.retrieve(query))
""",
        "<skip>",
    )
    pipeline = ns["pipeline"]
    assert ns["ran"] == [] and "answer" not in ns
    assert ns["retriever"].loads == 0  # nothing loaded
    assert pipeline.inputs == {"query": "What is a generator?", "ran": []}
    assert {n.label for n in pipeline.graph.nodes.values()} == {"llm.generate", "retriever.retrieve"}
    assert pipeline(query="loops") == ns["llm"].generate("loops", ns["retriever"].retrieve("loops"))


def test_run_false_keeps_an_installed_tracer() -> None:
    seen: list[str] = []

    def tracer(frame, event, arg):  # type: ignore[no-untyped-def]
        seen.append(event)
        return tracer

    ns = load_source("def run():\n    with patchkit.capture(run=False):\n        x = llm.generate('a')\n    return 1\n", "<t>")
    sys.settrace(tracer)
    try:
        assert ns["run"]() == 1
        after = sys.gettrace()
    finally:
        sys.settrace(None)
    assert after is tracer
    assert "call" in seen


def test_extraction_is_cached_per_code_object_and_offset() -> None:
    ns = load_source(
        "def run(qs):\n    out = []\n    for q in qs:\n        with patchkit.capture() as p:\n"
        "            a = llm.generate(q)\n        out.append(p)\n    return out\n",
        "<loop>",
    )
    before = capture_module.extract_block
    calls = []

    def counting(code, offset):  # type: ignore[no-untyped-def]
        calls.append(offset)
        return before(code, offset)

    capture_module.extract_block = counting
    try:
        pipelines = ns["run"](["a", "b", "c"])
    finally:
        capture_module.extract_block = before
    assert len(calls) == 1
    assert [p(q="x") for p in pipelines] == [ns["llm"].generate("x")] * 3


def test_unknown_input_names_the_known_ones() -> None:
    ns = load_source("def run(query):\n    with patchkit.capture():\n        return llm.generate(query)\n", "<in>")
    ns["run"]("hi")
    pipeline = patchkit.last_pipeline()
    with pytest.raises(InputError, match=r"unknown pipeline input 'querry'; did you mean 'query'\? \(inputs: query\)"):
        pipeline(querry="x")


def test_defaults_are_copied_per_run() -> None:
    source = "def run(query, seen=[]):\n    with patchkit.capture():\n        seen.append(query)\n        return len(seen)\n"
    ns = load_source(source, "<d>")
    ns["run"]("a")
    pipeline = patchkit.last_pipeline()
    assert pipeline() == 2 and pipeline() == 2


def test_output_name_that_is_never_assigned_is_a_capture_error() -> None:
    with pytest.raises(CaptureError, match=r"<out>:3: cannot capture output='answr'.*Did you mean 'answer'\?"):
        load_source("query = 'q'\n\nwith patchkit.capture(output='answr'):\n    answer = llm.generate(query)\n", "<out>")


def test_yield_in_block_is_refused_with_file_and_line() -> None:
    ns = load_source("def run(q):\n    with patchkit.capture():\n        yield llm.generate(q)\n", "<gen>")
    with pytest.raises(CaptureError, match=r"<gen>:3: cannot capture `yield` or `await`"):
        next(ns["run"]("a"))


def test_unsupported_as_target_is_refused() -> None:
    with pytest.raises(CaptureError, match="plain name"):
        load_source("class Box: pass\nbox = Box()\nwith patchkit.capture() as box.p:\n    a = llm.generate('x')\n", "<as>")


def test_nested_capture_is_refused() -> None:
    with pytest.raises(CaptureError, match="inside another capture block"):
        load_source("with patchkit.capture():\n    with patchkit.capture():\n        a = llm.generate('x')\n", "<nest>")


def test_failed_body_propagates_and_leaves_no_capture_active() -> None:
    ns = load_source("def run(q):\n    with patchkit.capture():\n        return flaky.check(q)\n", "<fail>")
    with pytest.raises(ValueError, match="cannot check"):
        ns["run"]("fail now")
    assert ns["run"]("ok") == "OK"


def test_last_pipeline_before_any_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    from patchkit.program import pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "_last", None)
    with pytest.raises(patchkit.PatchkitError, match="no pipeline captured yet"):
        patchkit.last_pipeline()


def test_component_error_inside_pipeline_run_keeps_traceback_in_user_code() -> None:
    ns = load_source("def run(q):\n    with patchkit.capture():\n        return flaky.check(q)\n", "<tb>")
    ns["run"]("fine")
    pipeline = patchkit.last_pipeline()
    with pytest.raises(ValueError) as info:
        pipeline(q="fail")
    frames = [f.filename for f in __import__("traceback").extract_tb(info.value.__traceback__)]
    assert "<tb>" in frames
