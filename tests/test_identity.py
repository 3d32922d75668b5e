"""A component's identity: what says an update keeps its workers (the same version) or starts new ones.

Each source below is a user's module as a script run again makes it: a fresh module, new classes and
functions. An edit of anything the component's behaviour depends on is a new identity, naming the part
that changed; an edit of nothing it reads (an unrelated global, a comment, a blank line) is the same one.
"""

from __future__ import annotations

import logging
import pickle
import types
from typing import Any

import cloudpickle
import pytest

import patchkit
from patchkit import reload
from patchkit.program import identity as ids

APP = '''\
import patchkit
from patchkit import Component, make

TEMPLATE = "Q: {question}"
UNRELATED = 1


def tidy(text):
    return text.strip()


def render(question):
    return TEMPLATE.format(question=tidy(question))


class Gen(Component):
    PROMPT = "Answer briefly. "

    def __init__(self, size=2):
        self.size = size

    @make
    def generate(self, question: str, mark: str = "!", *, tail: str = "") -> str:
        return self.PROMPT + render(question) + mark + tail
'''

# Each edit of the source above: what it replaces, with what, and the part the change names.
EDITS = {
    "class constant": ('PROMPT = "Answer briefly. "', 'PROMPT = "Answer at length. "', ["Gen.PROMPT"]),
    "module constant": ('TEMPLATE = "Q: {question}"', 'TEMPLATE = "Question: {question}"', ["module constant TEMPLATE"]),
    "helper": ("TEMPLATE.format(question=tidy(question))", "TEMPLATE.format(question=tidy(question)) + '.'",
               ["helper render"]),
    "helper of a helper": ("return text.strip()", "return text.strip().lower()", ["helper tidy"]),
    "default argument": ('mark: str = "!"', 'mark: str = "?"', ["Gen.generate default arguments"]),
    "keyword-only default": ('tail: str = ""', 'tail: str = "."', ["Gen.generate default arguments"]),
    "method code": ("+ mark + tail", "+ tail + mark", ["Gen.generate"]),
    "constructor default": ("size=2", "size=3", ["Gen.__init__ default arguments"]),
}


def module(source: str, name: str = "app") -> types.ModuleType:
    """`source` run as a module of its own, as a script run again makes one (not importable by name)."""
    made = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), made.__dict__)  # noqa: S102 - the test's own source
    return made


def gen(source: str = APP, **kwargs: Any) -> Any:
    return module(source).Gen(**kwargs)


@pytest.mark.parametrize("kind", list(EDITS))
def test_an_edit_of_what_the_code_reads_is_a_new_identity_naming_it(kind: str) -> None:
    old, new, named = EDITS[kind]
    edited = APP.replace(old, new)
    assert edited != APP
    before, after = gen(), gen(edited)
    assert ids.fingerprint(after) != ids.fingerprint(before)
    assert ids.identity(after).changes(ids.identity(before)) == named


def test_the_same_source_run_again_is_the_same_identity() -> None:
    assert ids.fingerprint(gen()) == ids.fingerprint(gen())


@pytest.mark.parametrize("edit", [
    ("UNRELATED = 1", "UNRELATED = 2"),  # a global no code of the component reads
    ("import patchkit\n", "\n\n# the app\nimport patchkit  # serving\n"),  # blank lines and comments: every line moves
    ("class Gen(Component):\n", "class Gen(Component):\n    \"\"\"Answers.\"\"\"\n\n"),  # a docstring
])
def test_an_edit_of_nothing_the_component_reads_is_the_same_identity(edit: tuple[str, str]) -> None:
    edited = APP.replace(*edit)
    assert edited != APP
    assert ids.fingerprint(gen(edited)) == ids.fingerprint(gen())


def test_constructor_arguments_are_values() -> None:
    assert ids.fingerprint(gen(size=3)) != ids.fingerprint(gen())
    assert ids.identity(gen(size=3)).changes(ids.identity(gen())) == ["constructor arguments"]
    assert ids.fingerprint(gen(size={"b": {3, "x", 1.5}, "a": [None]})) == ids.fingerprint(
        gen(size={"b": {1.5, "x", 3}, "a": [None]}))


def test_a_component_sent_to_another_process_keeps_its_identity() -> None:
    """The front-end reads a pipeline's components as cloudpickle rebuilt them: a script's functions by value,
    each with only the globals it reads."""
    made = module(APP)
    component = made.Gen(size={"k": {"x", "y"}, "format": made.render})
    copy = pickle.loads(cloudpickle.dumps(component))
    rebuilt = copy._patchkit_spec.kwargs["size"]["format"]
    assert rebuilt is not made.render and "UNRELATED" not in rebuilt.__globals__
    assert ids.identity(copy) == ids.identity(component)


RECURSIVE = APP.replace("def tidy(text):\n    return text.strip()", '''\
def tidy(text):
    return text.strip() if not text.endswith(" ") else tidy(text[:-1])


def walk(node):
    def visit(inner):
        return [inner] + [x for child in inner.get("children", []) for x in visit(child)]
    return visit(node)


LIMIT = 5
''').replace("return self.PROMPT", "walk({})\n        return self.PROMPT")


def test_recursion_and_nested_functions_are_followed() -> None:
    first = ids.identity(gen(RECURSIVE))
    assert ids.identity(gen(RECURSIVE)) == first
    assert {"helper tidy", "helper walk"} <= set(first.parts)
    edited = RECURSIVE.replace('inner.get("children", [])', 'inner.get("kids", [])')
    assert ids.identity(gen(edited)).changes(first) == ["helper walk"]


def test_a_closure_s_values_count() -> None:
    source = APP.replace("def render(question):", '''\
def suffixed(suffix):
    def add(text):
        return text + suffix
    return add


shout = suffixed("!")


def render(question):
    question = shout(question)''')
    first = ids.identity(gen(source))
    assert ids.identity(gen(source.replace('suffixed("!")', 'suffixed("?")'))).changes(first) == ["helper shout"]


def test_a_helper_class_and_an_object_count_by_their_content() -> None:
    source = APP.replace("def render(question):", '''\
class Style:
    SEPARATOR = ": "


class Settings:
    def __init__(self, width):
        self.width = width


SETTINGS = Settings(40)


def render(question):
    question = question[:SETTINGS.width] + Style.SEPARATOR''')
    first = ids.identity(gen(source))
    assert ids.identity(gen(source.replace('SEPARATOR = ": "', 'SEPARATOR = " - "'))).changes(first) == ["class Style"]
    assert ids.identity(gen(source.replace("Settings(40)", "Settings(80)"))).changes(first) == [
        "module constant SETTINGS"]


def test_installed_and_patchkit_code_counts_by_name() -> None:
    """A helper of the standard library or an installed package is not followed into: its name is its part."""
    source = APP.replace("import patchkit\n", "import textwrap\n\nimport patchkit\n").replace(
        "return text.strip()", "return textwrap.dedent(text).strip()")
    first = ids.identity(gen(source))
    assert first.parts["module textwrap"] == ids.identity(gen(source)).parts["module textwrap"]
    assert not any("dedent" in label or "_whitespace" in label for label in first.parts)


def test_an_object_without_a_stable_digest_falls_back_to_its_type_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="patchkit.program.identity")
    source = APP.replace("UNRELATED = 1", "import threading\n\nLOCK = threading.Lock()").replace(
        "return text.strip()", "with LOCK:\n        return text.strip()")
    assert ids.fingerprint(gen(source)) == ids.fingerprint(gen(source))  # two locks: one digest
    assert any("no stable digest" in message and "lock" in message for message in caplog.messages)


def test_a_held_component_counts_by_its_identity() -> None:
    holder_source = APP + '''

class Judge(Component):
    def __init__(self, llm):
        self.llm = llm

    @make
    def judge(self, question: str) -> str:
        return self.llm.generate(question)
'''
    first = module(holder_source)
    again = module(holder_source.replace('PROMPT = "Answer briefly. "', 'PROMPT = "Answer at length. "'))
    assert ids.fingerprint(first.Judge(first.Gen())) == ids.fingerprint(module(holder_source).Judge(module(holder_source).Gen()))
    assert ids.identity(again.Judge(again.Gen())).changes(ids.identity(first.Judge(first.Gen()))) == ["constructor arguments"]


PIPELINE = APP + '''

def clean(answer):
    return answer.strip() + SIGN


SIGN = " -- bot"
gen = Gen()


def answer(question="  what is a loop? "):
    with patchkit.capture() as pipeline:
        return clean(gen.generate(question))
    return pipeline
'''


def pipeline_of(source: str) -> patchkit.Pipeline:
    made = module(source)
    made.answer()
    return patchkit.last_pipeline()


def test_a_pipeline_s_identity_covers_the_globals_its_own_code_reads() -> None:
    first = pipeline_of(PIPELINE)
    assert first.fingerprint() == pipeline_of(PIPELINE).fingerprint()
    edited = pipeline_of(PIPELINE.replace('SIGN = " -- bot"', 'SIGN = " -- assistant"'))
    assert edited.fingerprint() != first.fingerprint()
    assert reload.changes(reload.identities(first), reload.identities(edited)) == ["the pipeline changed: module constant SIGN"]
    assert pipeline_of(PIPELINE.replace("UNRELATED = 1", "UNRELATED = 3")).fingerprint() == first.fingerprint()


def test_changes_name_each_component_and_what_changed_in_it() -> None:
    first = pipeline_of(PIPELINE)
    edited = PIPELINE.replace('PROMPT = "Answer briefly. "', 'PROMPT = "Go. "').replace(
        'TEMPLATE = "Q: {question}"', 'TEMPLATE = "{question}?"')
    assert reload.changes(reload.identities(first), reload.identities(pipeline_of(edited))) == [
        "gen changed: Gen.PROMPT, module constant TEMPLATE"]
    assert reload.changes(reload.identities(first), reload.identities(pipeline_of(PIPELINE))) == []


def test_an_object_that_raises_when_read_never_fails_an_identity() -> None:
    source = APP.replace("UNRELATED = 1", '''\
class Proxy:
    def __getattribute__(self, name):
        raise RuntimeError("a proxy reads nothing here")


REMOTE = Proxy()''').replace("return text.strip()", "return REMOTE and text.strip()")
    assert ids.fingerprint(gen(source)) == ids.fingerprint(gen(source))
    assert "module constant REMOTE" in ids.identity(gen(source)).parts


def test_a_property_counts_by_each_of_its_functions() -> None:
    source = APP.replace("    @make\n", '''\
    @property
    def width(self):
        return self.size

    @width.setter
    def width(self, value):
        self.size = value

    @make
''')
    first = ids.identity(gen(source))
    edited = source.replace("self.size = value", "self.size = max(value, 1)")
    assert ids.identity(gen(edited)).changes(first) == ["Gen.width"]
