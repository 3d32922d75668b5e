"""Capture from a real script and from `python -c`; a pickled pipeline answers the same in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

SCRIPT = textwrap.dedent(
    """
    import sys, cloudpickle
    sys.path.insert(0, {tests!r})
    import patchkit
    from components import Generator, Grader, Retriever

    retriever, grader, llm = Retriever(topk=2), Grader(threshold=1), Generator(prefix="S")
    query = "How do I catch an exception?"
    with patchkit.capture() as pipeline:
        docs = retriever.retrieve(query)
        if not grader.grade(query, docs):
            docs = retriever.retrieve(llm.rewrite(query))
        answer = llm.generate(query, docs)
    with open(sys.argv[1], "wb") as f:
        cloudpickle.dump(pipeline, f)
    print(answer)
    """
)

LOADER = textwrap.dedent(
    """
    import json, pickle, sys
    sys.path.insert(0, {tests!r})
    with open(sys.argv[1], "rb") as f:
        pipeline = pickle.load(f)
    queries = ["What is a generator?", "nothing matches here", "How do I catch an exception?"]
    print(json.dumps([pipeline(query=q) for q in queries]))
    """
)


def _run(args: list[str], cwd: Path) -> str:
    done = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _expected(queries: list[str]) -> list[str]:
    sys.path.insert(0, str(TESTS))
    from components import Generator, Grader, Retriever

    retriever, grader, llm = Retriever(topk=2), Grader(threshold=1), Generator(prefix="S")
    out = []
    for query in queries:
        docs = retriever.retrieve(query)
        if not grader.grade(query, docs):
            docs = retriever.retrieve(llm.rewrite(query))
        out.append(llm.generate(query, docs))
    return out


@pytest.mark.slow
def test_pipeline_from_a_script_answers_the_same_in_a_fresh_process(tmp_path: Path) -> None:
    script = tmp_path / "pipeline.py"
    script.write_text(SCRIPT.format(tests=str(TESTS)))
    (tmp_path / "load.py").write_text(LOADER.format(tests=str(TESTS)))
    eager = _run([str(script), "pipeline.pkl"], tmp_path)
    assert eager == _expected(["How do I catch an exception?"])[0]
    answers = json.loads(_run(["load.py", "pipeline.pkl"], tmp_path))
    assert answers == _expected(["What is a generator?", "nothing matches here", "How do I catch an exception?"])


@pytest.mark.slow
def test_capture_in_python_dash_c(tmp_path: Path) -> None:
    code = SCRIPT.format(tests=str(TESTS)).replace("sys.argv[1]", "'c.pkl'")
    assert _run(["-c", code], tmp_path) == _expected(["How do I catch an exception?"])[0]
    (tmp_path / "load.py").write_text(LOADER.format(tests=str(TESTS)))
    assert json.loads(_run(["load.py", "c.pkl"], tmp_path))[0] == _expected(["What is a generator?"])[0]
