"""An update serves the code as edited: `endpoint.update()` and `patchkit serve --reload` start a new worker
for an edit of anything a component's behaviour depends on (a class constant, a module constant, a helper its
method calls or a helper of that helper, a method's default argument), and the served answer becomes the one
plain Python gives; an edit of nothing it reads (an unrelated global, blank lines, a comment) keeps the worker.
"""

from __future__ import annotations

import json
import re
import runpy
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from serving import serve_cli

import patchkit

# A script as the docs write one: components, helpers and constants at module level, the capture after them.
APP = '''\
import patchkit
from patchkit import Component, make

TEMPLATE = "Q: {{question}}"
UNRELATED = 1


def tidy(text):
    return {tidy}


def render(question):
    return {render}


class Gen(Component):
    PROMPT = {prompt!r}

    @make
    def generate(self, question: str, mark: str = {mark!r}) -> str:
        return self.PROMPT + render(question) + mark


gen = Gen()
question = "  What is a loop? "
with patchkit.capture() as pipeline:
    answer = gen.generate(question)
'''

FIRST = {"tidy": "text.strip()", "render": "TEMPLATE.format(question=tidy(question))", "prompt": "Answer. ", "mark": "!"}

# Each edit, made on top of those before it: the source's fields it changes, and what the reload log names.
EDITS = [
    ("class constant", {"prompt": "Answer briefly. "}, "Gen.PROMPT"),
    ("module constant", {"template": "Question: {{question}}"}, "module constant TEMPLATE"),
    ("helper", {"render": "'<' + TEMPLATE.format(question=tidy(question)) + '>'"}, "helper render"),
    ("helper of a helper", {"tidy": "text.strip().lower()"}, "helper tidy"),
    ("default argument", {"mark": "?!"}, "Gen.generate default arguments"),
]


def source(fields: dict[str, str], *, untouched_edit: bool = False) -> str:
    text = APP.format(**{k: v for k, v in fields.items() if k != "template"})
    if "template" in fields:
        text = text.replace('TEMPLATE = "Q: {question}"', f"TEMPLATE = {fields['template'].format()!r}")
    if untouched_edit:  # blank lines, a comment and a global no code reads: every line moves, nothing read changes
        text = "# the app, edited\n\n\n" + text.replace("UNRELATED = 1", "UNRELATED = 2\n\n")
    return text


def load(script: Path) -> patchkit.Pipeline:
    """The script run again, as a restart or `--reload` runs it: new classes, helpers and objects."""
    pipeline: patchkit.Pipeline = runpy.run_path(str(script), run_name="app")["pipeline"]
    return pipeline


def gen_pid(stats: Callable[[], dict[str, Any]]) -> int:
    """The process of the one worker of `Gen` that serves, once the version before has stopped its own."""
    pids: list[int] = []

    def one() -> bool:
        gens = [c for c in stats()["components"].values() if c["class"] == "Gen"]
        pids[:] = [r["pid"] for c in gens for r in c["replicas"] if r["state"] == "serving"]
        return len(gens) == 1 and len(pids) == 1

    wait_until(one, "one worker of Gen serving")
    return pids[0]


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_update_serves_each_edit_and_keeps_the_worker_when_nothing_read_changed(tmp_path: Path) -> None:
    script = tmp_path / "app.py"
    fields = dict(FIRST)
    script.write_text(source(fields))
    question = "  How do I catch an exception? "
    with patchkit.deploy(load(script)) as endpoint:
        served = endpoint.query(question=question)
        assert served == load(script)(question=question)
        for kind, change, _ in EDITS:
            fields.update(change)
            script.write_text(source(fields))
            edited = load(script)
            expected = edited(question=question)  # plain Python's answer, run here
            assert expected != served, kind
            before = gen_pid(endpoint.stats)
            endpoint.update(edited)
            served = endpoint.query(question=question)
            assert served == expected, kind
            assert gen_pid(endpoint.stats) != before, kind

        script.write_text(source(fields, untouched_edit=True))
        before = gen_pid(endpoint.stats)
        endpoint.update(load(script))
        assert endpoint.query(question=question) == served
        assert gen_pid(endpoint.stats) == before  # nothing it reads changed: the same worker serves


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as reply:  # noqa: S310 - the local test server
        return json.loads(reply.read())


def _query(url: str, **inputs: Any) -> tuple[Any, str]:
    request = urllib.request.Request(url + "/v1/query", data=json.dumps({"inputs": inputs}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:  # noqa: S310 - the local test server
        return json.loads(reply.read())["output"], reply.headers["X-Pipeline-Version"]


def _version(url: str) -> int:
    return int(_get(url + "/v1/pipelines")["pipelines"][0]["version"])


@pytest.mark.slow
def test_serve_reload_serves_each_edit_names_it_and_restarts_nothing_for_an_edit_of_nothing(tmp_path: Path) -> None:
    script = tmp_path / "app.py"
    fields = dict(FIRST)
    script.write_text(source(fields))
    question = "  Why use a generator? "
    with serve_cli(tmp_path, "app.py", "--reload") as (_, url, log):
        assert _query(url, question=question)[0] == load(script)(question=question)
        for number, (kind, change, named) in enumerate(EDITS, start=2):
            before = gen_pid(lambda: _get(url + "/v1/stats"))
            fields.update(change)
            script.write_text(source(fields))
            expected = load(script)(question=question)
            wait_until(lambda n=number: _version(url) == n, f"version {number} ({kind}) serving")
            output, version = _query(url, question=question)
            assert (output, version[:2]) == (expected, f"{number}-"), kind
            assert gen_pid(lambda: _get(url + "/v1/stats")) != before, kind
            assert re.search(rf"INFO patchkit.reload: reloading app.py: gen changed: {named}$", log.read_text(), re.M), kind

        before, count = gen_pid(lambda: _get(url + "/v1/stats")), log.read_text().count("did not change")
        script.write_text(source(fields, untouched_edit=True))
        wait_until(lambda: log.read_text().count("did not change") > count, "the unchanged reload logged")
        assert _query(url, question=question) == (expected, version)
        assert gen_pid(lambda: _get(url + "/v1/stats")) == before and _version(url) == len(EDITS) + 1



def answer_with(gen: Any, question: str = "what is a loop?") -> Any:
    with patchkit.capture():
        return gen.generate(question)


def test_an_object_deployed_then_edited_in_place_is_named_in_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """One object is one component: an update keeps its workers, and says that the edit is not deployed."""
    script = tmp_path / "app.py"
    script.write_text(source(FIRST))
    made = runpy.run_path(str(script), run_name="app")
    with patchkit.deploy(made["pipeline"], backend="inprocess") as endpoint:
        made["Gen"].PROMPT = "Answer at length. "  # the class edited in place, as a notebook cell may
        answer_with(made["gen"])
        endpoint.update(patchkit.last_pipeline())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "object deployed" in r.getMessage()]
    assert warnings == ["gen is the object deployed, but what its code reads changed since: it keeps its workers, which "
                        "start no new version of it; make the object again to deploy the edit"]
