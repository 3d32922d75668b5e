"""Issue 18: code users write around and inside a capture, compared with plain Python eagerly and
deployed, and the two constructs refused with a CaptureError that names the fix.

The corpus cases of `corpus.FIDELITY` run through every corpus test (eagerly in
test_capture_corpus.py, deployed inprocess in test_frontend.py, on workers in test_deploy_local.py);
the tests here check what each class adds: no stray inputs, objects bound by identity, components
that get workers whether or not the capture run called them, and the error texts.
"""

from __future__ import annotations

from typing import Any

from conftest import load_source
from corpus import FIDELITY
from test_capture_corpus import _capture

import patchkit

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


def test_a_capture_inside_another_statement_deploys_with_its_own_inputs_only() -> None:
    pipeline, _ = _capture(CASE["capture_inside_try_finally"])
    expected = [pipeline(query=q) for q in OTHERS]
    with patchkit.deploy(pipeline, backend="inprocess") as endpoint:  # every input is required
        assert [endpoint.query(query=q) for q in OTHERS] == expected
