"""The example pipelines on real components (the pydoc index, SmolLM2), each deployed on worker
processes; `patchkit demo` and `patchkit serve` on them from the shell."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from serving import start_serve

pytest.importorskip("llama_cpp", reason="the examples answer with SmolLM2 through llama.cpp: pip install -e '.[llm]'")
pytest.importorskip("faiss", reason="the examples search a FAISS index: pip install -e '.[retrieval]'")

import patchkit  # noqa: E402
from patchkit.core import release_setup  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PYDOC_TITLES = {"try", "exceptions", "with", "break", "function", "typesseq", "class", "context-managers"}


def check_output(output: dict[str, object]) -> None:
    assert isinstance(output["answer"], str) and output["answer"].strip()
    assert isinstance(output["sources"], list) and output["sources"]
    assert all(isinstance(title, str) and title for title in output["sources"])


def as_json(value: object) -> object:
    """What a value reads as once it has crossed the HTTP API (tuples become lists)."""
    return json.loads(json.dumps(value))


@pytest.mark.parametrize(
    ("name", "extra"), [("oneshot", ()), ("hyde", ("passage",)), ("multistep", ("sub_questions",)), ("ircot", ("rounds",))]
)
def test_example_answers_deployed_exactly_as_eagerly(name: str, extra: tuple[str, ...]) -> None:
    example = importlib.import_module(f"patchkit.examples.{name}")
    try:
        _check_deployed_as_eagerly(example, name, extra)
    finally:  # the eager run loaded the example's models here: free them for the tests after this one
        for component in example.pipeline.components.values():
            release_setup(component)


def _check_deployed_as_eagerly(example: Any, name: str, extra: tuple[str, ...]) -> None:
    assert set(example.pipeline.inputs) == {"question"}  # requests need only the question
    questions = example.QUESTIONS[:2]
    eager = [as_json(example.pipeline(question=question)) for question in questions]
    with patchkit.deploy(example.pipeline, batch_size=4) as endpoint:
        deployed = [endpoint.query(question=question) for question in questions]
        stats = endpoint.stats()["components"]
    assert deployed == eager  # SmolLM2 decodes greedily: distribution changes speed, never answers
    for output in deployed:
        check_output(output)
        assert all(key in output for key in extra)
    assert stats["retriever"]["methods"]["retrieve"]["calls"] >= 2
    if name == "ircot":
        assert all(1 <= output["rounds"] <= 3 for output in deployed)
        assert stats["llm"]["methods"]["generate"]["calls"] == sum(output["rounds"] for output in deployed)
    if name == "multistep":
        assert all(1 <= len(output["sub_questions"]) <= 3 for output in deployed)


def test_demo_deploys_crag_and_prints_answers_sources_and_the_table() -> None:
    questions = ["How do I catch an exception in Python?", "What does the with statement do?", "What is a generator?"]
    done = subprocess.run(
        [sys.executable, "-m", "patchkit.cli", "demo", *questions], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for question in questions:
        assert f"Q: {question}\nA: " in done.stdout
    sources = re.search(r"sources: (.+)", done.stdout)
    assert sources is not None and set(sources.group(1).split(", ")) & PYDOC_TITLES
    table = done.stdout[done.stdout.index("component ") :]
    for row in ("grader.grade", "llm.generate", "retriever.retrieve", "rewriter.rewrite", "web.search"):
        assert row in table
    # One LLM deployment serves grading, rewriting and answering: its engine ran several sequences per
    # step, and the answers reused the prompt prefixes (the documents) their grading evaluated.
    llm = re.search(r"llm\.generate\s+\d+\s+\d+\s+(\d+)\s+\d+\s+([\d.]+)\s+\d+\s+(\d+)/(\d+)", table)
    assert llm is not None, table
    calls, mean_batch, reused = int(llm.group(1)), float(llm.group(2)), int(llm.group(3))
    assert calls >= 2 * len(questions) and mean_batch > 1 and reused > 0


def test_an_example_serves_from_the_shell_with_only_the_question() -> None:
    server, url = start_serve(ROOT / "examples" / "oneshot.py")
    try:
        request = urllib.request.Request(
            url + "/v1/query", data=json.dumps({"inputs": {"question": "What does a with statement do?"}}).encode()
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            check_output(json.loads(reply.read())["output"])
    finally:
        server.terminate()
        server.wait(timeout=60)
        if server.stdout is not None:
            server.stdout.close()
