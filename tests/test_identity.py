"""A component's identity: what says an update keeps its workers (the same version) or starts new ones.

Each source below is a user's module as a script run again makes it: a fresh module, new classes and
functions. An edit of anything the component's behaviour depends on is a new identity, naming the part
that changed; an edit of nothing it reads (an unrelated global, a comment, a blank line) is the same one.
"""

from __future__ import annotations

import logging
import pickle
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import cloudpickle
import numpy as np
import pytest

import patchkit
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
    caplog.set_level(logging.DEBUG, logger="patchkit.program.walk")
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
    assert edited.stamp().changes(first.stamp()) == ["the pipeline changed: module constant SIGN"]
    assert pipeline_of(PIPELINE.replace("UNRELATED = 1", "UNRELATED = 3")).fingerprint() == first.fingerprint()


def test_changes_name_each_component_and_what_changed_in_it() -> None:
    first = pipeline_of(PIPELINE)
    edited = PIPELINE.replace('PROMPT = "Answer briefly. "', 'PROMPT = "Go. "').replace(
        'TEMPLATE = "Q: {question}"', 'TEMPLATE = "{question}?"')
    assert pipeline_of(edited).stamp().changes(first.stamp()) == [
        "gen changed: Gen.PROMPT, module constant TEMPLATE"]
    assert pipeline_of(PIPELINE).stamp().changes(first.stamp()) == []


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


# -- what a version is, where users stand ---------------------------------------------------------------------
PROMPTS = '''\
HEADER = "Q: "


def fmt(question):
    return HEADER + question.strip()
'''

USES_PROMPTS = '''\
import prompts
from patchkit import Component, make


class Gen(Component):
    @make
    def generate(self, question: str) -> str:
        return prompts.fmt(question) + prompts.HEADER
'''


def test_a_helper_reached_through_a_module_of_the_user_s_is_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import prompts` ... `prompts.fmt(q)`: an edit of `prompts` is a new version, named by its path."""
    def gen_with(prompts_source: str) -> Any:
        monkeypatch.setitem(sys.modules, "prompts", module(prompts_source, "prompts"))
        return module(USES_PROMPTS).Gen()

    first = ids.identity(gen_with(PROMPTS))
    assert ids.identity(gen_with(PROMPTS)) == first
    assert {"helper prompts.fmt", "module constant prompts.HEADER"} <= set(first.parts)
    edited = ids.identity(gen_with(PROMPTS.replace("question.strip()", "question.strip().upper()")))
    assert edited.changes(first) == ["helper prompts.fmt"]
    assert ids.identity(gen_with(PROMPTS.replace('"Q: "', '"Question: "'))).changes(first) == [
        "module constant prompts.HEADER"]


def test_whose_code_a_module_is_comes_from_its_name_and_the_installed_distributions() -> None:
    assert not ids.users_module("json") and not ids.users_module("patchkit.components")
    assert not ids.users_module("numpy") and not ids.users_module("yaml")  # installed distributions
    assert ids.users_module("app") and ids.users_module("__main__") and ids.users_module("my_project.prompts")


def test_the_user_s_module_beside_an_installed_one_of_its_name_is_the_user_s(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A top-level name a distribution provides (`yaml`), loaded from a file of the user's: the user's code."""
    (tmp_path / "yaml.py").write_text("X = 1\n")
    mine = types.ModuleType("yaml")
    mine.__file__ = str(tmp_path / "yaml.py")
    monkeypatch.setitem(sys.modules, "yaml", mine)
    assert ids.users_module("yaml")


def test_values_digest_by_what_they_hold_never_by_repr() -> None:
    """numpy elides the middle of a large array's repr: an edit there is still a new version."""
    array = np.arange(1_000_000, dtype=np.float32)
    edited = array.copy()
    edited[500_000] += 1
    assert "..." in repr(array) and repr(edited) == repr(array)
    assert ids.fingerprint(gen(size=edited)) != ids.fingerprint(gen(size=array))
    assert ids.fingerprint(gen(size=array.copy())) == ids.fingerprint(gen(size=array))
    assert ids.fingerprint(gen(size=array.astype(np.float64))) != ids.fingerprint(gen(size=array))
    assert ids.fingerprint(gen(size=10**5000)) != ids.fingerprint(gen(size=10**5000 + 1))  # past int's decimal limit
    assert ids.fingerprint(gen(size=0.1 + 0.2)) != ids.fingerprint(gen(size=0.3))


OBJECT_INPUT = '''\
import sys
sys.path.insert(0, {tests!r})
import patchkit
from patchkit import Component, make


class Settings:
    def __init__(self, width):
        self.width = width


class Gen(Component):
    @make
    def generate(self, question: str, settings) -> str:
        return question[: settings.width]


gen = Gen()
settings = Settings(5)
with patchkit.capture() as pipeline:
    answer = gen.generate("what is a loop?", settings)
print(pipeline.stamp().digest)
'''


def test_a_pipeline_s_version_is_the_same_in_every_process(tmp_path: Path) -> None:
    """An input holding an object of the default repr (an address in it) digests by its state."""
    script = tmp_path / "app.py"
    script.write_text(OBJECT_INPUT.format(tests=str(Path(__file__).parent)))
    digests = {subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout
               for _ in range(2)}
    assert len(digests) == 1
    script.write_text(OBJECT_INPUT.format(tests=str(Path(__file__).parent)).replace("Settings(5)", "Settings(6)"))
    assert subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True).stdout not in digests


def test_a_declared_version_and_the_files_read_are_parts_of_it(tmp_path: Path) -> None:
    source = APP.replace('    PROMPT = "Answer briefly. "', '''\
    PROMPT = "Answer briefly. "

    def version_files(self):
        return [self.size]''')
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "a.txt").write_text("loops repeat")
    first = ids.identity(gen(source, size=str(corpus)))
    (corpus / "b.txt").write_text("generators yield")
    assert ids.identity(gen(source, size=str(corpus))).changes(first) == ["files read"]
    (corpus / "b.txt").write_text("generators yield lazily")
    second = ids.identity(gen(source, size=str(corpus)))
    assert second.changes(first) == ["files read"] and ids.identity(gen(source, size=str(corpus))) == second

    declared = APP.replace('PROMPT = "Answer briefly. "', 'PROMPT = "Answer briefly. "\n    version = "2026-11"')
    assert ids.identity(gen(declared.replace("2026-11", "2026-12"))).changes(ids.identity(gen(declared))) == [
        "Gen.version", "declared version"]


def test_a_retriever_over_a_directory_is_a_new_version_when_a_file_is_added(tmp_path: Path) -> None:
    from patchkit.components import FaissRetriever

    (tmp_path / "loops.md").write_text("A for loop repeats a block.")
    first = ids.identity(FaissRetriever(corpus=str(tmp_path)))
    assert ids.identity(FaissRetriever(corpus=str(tmp_path))) == first
    (tmp_path / "generators.md").write_text("A generator yields values.")
    assert ids.identity(FaissRetriever(corpus=str(tmp_path))).changes(first) == ["files read"]


def test_the_profile_cache_keys_by_the_version_so_an_edit_is_profiled_again() -> None:
    from patchkit.scheduler.offline.cache import digest

    slower = APP.replace("return self.PROMPT + render(question)",
                         "time.sleep(0.05)\n        return self.PROMPT + render(question)")
    slower = slower.replace("import patchkit\n", "import time\n\nimport patchkit\n")
    assert digest(gen()) == digest(gen())  # another object built alike: the same profile
    assert digest(gen(slower)) != digest(gen())
    assert digest(gen(size=3)) != digest(gen())


def test_stamping_reads_a_value_shared_by_components_once_and_ships_the_version() -> None:
    made = module(PIPELINE)
    shared = np.zeros(1 << 20, dtype=np.uint8)
    made.gen = made.Gen(size=shared)
    made.answer()
    pipeline = patchkit.last_pipeline()
    memo = ids.Memo()
    version = pipeline.stamp(memo)
    assert memo.get(shared) is not None  # read once, kept for the other components of the deployment
    assert pipeline.stamped == version and version.digest == pipeline.fingerprint()
    component = pipeline.components["gen"]
    assert ids.stamped_digest(component) == version.components["gen"].digest
    copy = pickle.loads(cloudpickle.dumps(pipeline))  # as the front-end receives it: the versions come along
    assert copy.stamped == version and ids.stamped_digest(copy.components["gen"]) == ids.stamped_digest(component)
    with pytest.raises(patchkit.PatchkitError, match="carries no version"):
        ids.stamped_digest(made.Gen())


def test_a_pipeline_s_inputs_digest_by_value() -> None:
    """An input's default edited in the middle of a large array (which its repr elides) is a new version."""
    def answer_over(weights: Any) -> patchkit.Pipeline:
        made = module(PIPELINE)
        with patchkit.capture() as pipeline:
            scaled = made.gen.generate(str(weights.sum()))
        assert scaled
        return pipeline

    weights = np.ones(100_000)
    edited = weights.copy()
    edited[50_000] = 2.0
    assert repr(edited) == repr(weights)
    assert answer_over(edited).fingerprint() != answer_over(weights).fingerprint()
    assert answer_over(weights.copy()).fingerprint() == answer_over(weights).fingerprint()
