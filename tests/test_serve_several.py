"""`patchkit serve` with several pipelines, and `--reload`.

Targets on the command line (`NAME=` or a default name) and the config file's `pipelines:` map are served
by name, each at `/v1/pipelines/{name}/query` and listed by `GET /v1/pipelines`; a mistake in naming them is
one line and exit status 2 before anything loads. `--reload` serves a changed file as the pipeline's next
version, and a file that fails to load or start leaves the version before serving, with one ERROR line
saying why.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from serving import serve_cli

from patchkit import ConfigError
from patchkit.cli.commands import main, parser, serve_settings
from patchkit.cli.targets import Target, load_pipeline, serve_targets, source_file
from patchkit.config import DeploymentConfig
from patchkit.config import file as cf
from patchkit.reload import Reloader, Watched, reason, stamp
from patchkit.server.process import FrontendServer

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"

# A script whose component is defined in it (so each run of the script makes the class again, as an edited
# file does) and whose `setup()` fails for one mark: {mark} is the component's argument, {after} the code after
# its call.
SHOUT = '''\
import patchkit
from patchkit import Component, make


class Shout(Component):
    def __init__(self, mark: str) -> None:
        self.mark = mark

    def setup(self) -> None:
        if self.mark == "boom":
            raise RuntimeError("no mark called boom")

    @make
    def shout(self, text: str) -> str:
        return text.upper() + self.mark


shout = Shout({mark!r})
text = "hi"
with patchkit.capture(run=False) as pipeline:
    answer = shout.shout(text){after}
'''

# Two pipelines on the test suite's own components.
GENERATE = '''\
import patchkit
from components import Generator

generator = Generator(prefix="G")
question = "what is a generator?"
with patchkit.capture(run=False) as pipeline:
    answer = generator.generate(question)
'''

LOOKUP = '''\
import patchkit
from components import Retriever

retriever = Retriever()
key = "loops"
with patchkit.capture(run=False) as pipeline:
    found = retriever.lookup(key)
'''


def _shout(mark: str = "!", after: str = "") -> str:
    return SHOUT.format(mark=mark, after=after)


# -- naming the pipelines ---------------------------------------------------------------------------------------
def test_a_target_is_named_by_its_prefix_else_by_its_file_or_attribute() -> None:
    assert Target.parse("crag=examples/crag.py") == Target("crag", "examples/crag.py")
    assert Target.parse("hyde=pkg.mod:pipeline") == Target("hyde", "pkg.mod:pipeline")
    assert Target.parse("examples/crag.py") == Target("crag", "examples/crag.py", named=False)
    assert Target.parse("pkg.mod:app.pipeline") == Target("pipeline", "pkg.mod:app.pipeline", named=False)
    assert Target.parse("dir=x/app.py").name == "dir"
    assert Target.parse("a/b=c.py") == Target("b=c", "a/b=c.py", named=False)  # a path, not a name
    with pytest.raises(ConfigError, match="names no pipeline: write NAME=FILE.py"):
        Target.parse("crag=")


def test_targets_come_from_the_command_line_or_the_file_not_both(tmp_path: Path) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text("pipelines:\n  crag: crag.py\n  hyde: {target: 'app:hyde'}\n")
    values = serve_settings(parser().parse_args(["serve", "--config", str(path)]))
    assert serve_targets([], values, str(path)) == [Target("crag", "crag.py"), Target("hyde", "app:hyde")]
    with pytest.raises(ConfigError, match=r"from the command line \(other.py\) or from .*deploy.yaml's `pipelines:` "
                                          r"\(crag, hyde\), not both: drop one"):
        serve_targets(["other.py"], values, str(path))
    with pytest.raises(ConfigError, match="name a pipeline to serve: FILE.py or module:attribute"):
        serve_targets([], {}, None)


def test_two_pipelines_of_one_name_say_how_to_name_them_apart() -> None:
    with pytest.raises(ConfigError) as raised:
        serve_targets(["a/app.py", "b/app.py"], {}, None)
    assert str(raised.value) == ("2 pipelines are named 'app' (a/app.py, b/app.py): name each as NAME=TARGET, such as "
                                 "app1=a/app.py app2=b/app.py")
    with pytest.raises(ConfigError, match=r"pipelines are named 'x' \(x.py, m:x\)"):
        serve_targets(["x=x.py", "m:x"], {}, None)
    with pytest.raises(ConfigError, match=r"got 'my app' \(made from 'd/my app.py': name it as NAME=d/my app.py\)"):
        serve_targets(["d/my app.py"], {}, None)


def test_a_naming_mistake_is_one_line_and_exit_2_before_anything_loads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "a/app.py", "b/app.py"]) == 2  # neither file exists: nothing was loaded
    assert capsys.readouterr().err.splitlines() == [
        "patchkit serve: 2 pipelines are named 'app' (a/app.py, b/app.py): name each as NAME=TARGET, such as "
        "app1=a/app.py app2=b/app.py"]


def test_a_script_that_captures_nothing_is_refused_even_after_another_captured(tmp_path: Path) -> None:
    (tmp_path / "shout.py").write_text(_shout())
    (tmp_path / "empty.py").write_text("x = 1\n")
    assert load_pipeline(str(tmp_path / "shout.py")).components
    with pytest.raises(ConfigError, match=r"empty.py ran no `with patchkit.capture\(\):` block"):
        load_pipeline(str(tmp_path / "empty.py"))  # the capture before it is shout.py's, not empty.py's


def test_a_module_target_is_imported_again_and_its_own_file_watched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "loudapp").mkdir()
    (tmp_path / "loudapp" / "__init__.py").write_text("")
    module = tmp_path / "loudapp" / "main.py"
    module.write_text(_shout("!"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "loudapp", raising=False)
    monkeypatch.delitem(sys.modules, "loudapp.main", raising=False)
    assert source_file("loudapp.main:pipeline") == module
    first = load_pipeline("loudapp.main:pipeline")
    module.write_text(_shout("?"))
    assert load_pipeline("loudapp.main:pipeline") is first  # imported once: the same module, the same pipeline
    again = load_pipeline("loudapp.main:pipeline", again=True)
    assert again is not first and again(text="yo") == "YO?"
    sys.modules.pop("loudapp.main", None)
    sys.modules.pop("loudapp", None)


# -- the config file's pipelines: --------------------------------------------------------------------------------
PIPELINES = """\
slo_ms: 2000
plan: auto
pipelines:
  crag: examples/crag.py
  hyde: {target: "app.hyde:pipeline", slo_ms: 500, priority: 2, weight: 3}
  fast: {target: fast.py, weight: 0.5}
"""


def _settings(tmp_path: Path, text: str, *flags: str) -> dict[str, Any]:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return serve_settings(parser().parse_args(["serve", "--config", str(path), *flags]))


def test_the_pipelines_map_sets_options_by_pipeline_over_the_top_level(tmp_path: Path) -> None:
    values = _settings(tmp_path, PIPELINES)
    arguments = cf.deploy_arguments(values, ["generator"])
    assert arguments["slo_ms"] == {"crag": 2000, "hyde": 500, "fast": 2000}
    assert arguments["priority"] == {"hyde": 2}  # no top-level value to give the others
    assert "pipelines" not in arguments
    assert cf.plan_weights(values) == {"crag": 1.0, "hyde": 3.0, "fast": 0.5}
    only_own = cf.deploy_arguments(_settings(tmp_path, "pipelines:\n  a: a.py\n  b: {target: b.py, slo_ms: 90}\n"), [])
    assert only_own["slo_ms"] == {"b": 90} and "priority" not in only_own
    assert cf.plan_weights(_settings(tmp_path, "pipelines:\n  a: a.py\n")) is None  # equal shares


def test_the_slo_flag_overrides_every_pipeline_s_own(tmp_path: Path) -> None:
    values = _settings(tmp_path, PIPELINES, "--slo-ms", "700")
    arguments = cf.deploy_arguments(values, ["generator"])
    assert arguments["slo_ms"] == 700
    assert arguments["priority"] == {"hyde": 2}  # no flag: the file's


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("pipelines:\n  a: {target: a.py, slo: 1}\n", "unknown key 'slo' in pipelines.a; did you mean 'slo_ms'?"),
        ("pipelines:\n  a: {slo_ms: 1}\n", "pipelines.a.target Field required"),
        ("pipelines:\n  a: {target: a.py, slo_ms: 0}\n", "pipelines.a.slo_ms should be greater than 0; got 0"),
        ("pipelines:\n  a: {target: a.py, weight: -1}\n", "pipelines.a.weight should be greater than or equal to 0"),
        ("pipelines:\n  a: {target: a.py, priority: high}\n", "pipelines.a.priority should be a valid integer"),
        ("pipelines:\n  a: ' '\n", "pipelines.a.target must be FILE.py or module:attribute"),
        ("pipelines:\n  a: 3\n", "pipelines.a should be a valid dictionary"),
        ("pipelines: [a.py]\n", "pipelines should be a valid dictionary"),
    ],
)
def test_a_bad_pipeline_entry_is_one_line_naming_its_path(tmp_path: Path, text: str, line: str) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        cf.load(path)
    assert str(raised.value).startswith(f"{path}: {line}"), str(raised.value)


def test_serve_help_and_the_options_table_list_the_pipelines_keys(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    assert "[NAME=]FILE.py|module:attribute" in shown and "--reload" in shown
    assert re.search(r"^  pipelines: \{NAME: \{\.\.\.\}\}\s+the pipelines to serve", shown, re.M)
    assert re.search(r"^    weight\s+with plan: auto, its share of the requests", shown, re.M)
    table = cf.markdown_table()
    for key in cf.PipelineOptions.model_fields:
        assert f"| `pipelines.NAME.{key}` |" in table


# -- --reload, on the server's loop (inprocess workers) ---------------------------------------------------------
def test_reload_reason_is_one_line_naming_the_file_and_line(tmp_path: Path) -> None:
    script = tmp_path / "app.py"
    script.write_text("x = 1\nx = (\n")
    with pytest.raises(SyntaxError) as syntax:
        compile(script.read_text(), str(script), "exec")
    assert reason(syntax.value, script).endswith("app.py, line 2: SyntaxError: '(' was never closed")
    script.write_text("import no_such_module_here\n")
    with pytest.raises(ModuleNotFoundError) as missing:
        load_pipeline(str(script))
    assert reason(missing.value, script).endswith(
        "app.py, line 1: ModuleNotFoundError: No module named 'no_such_module_here'")


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.05)


def test_the_reloader_serves_each_change_and_keeps_the_version_before_when_one_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="patchkit.reload")
    script = tmp_path / "shout.py"
    script.write_text(_shout("!"))
    pipeline = load_pipeline(str(script))
    config = DeploymentConfig.resolve({"shout": pipeline}, backend="inprocess", port=0)

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "patchkit.reload" and r.levelno == logging.ERROR]

    async def body() -> None:
        server = FrontendServer({"shout": pipeline}, config)
        await server.start()
        watched = Watched("shout", script, functools.partial(load_pipeline, str(script), again=True), "shout.py", stamp(script))
        reloader = Reloader([watched], poll_s=0.05)
        reloader.start(server)
        versions = server.frontend.versions

        async def ask() -> tuple[str, str]:
            result = await server.frontend.query({"text": "hey"}, pipeline="shout")
            return result.output, result.version

        try:
            assert await ask() == ("HEY!", versions["shout"].tag)
            script.write_text(_shout("?"))
            await _until(lambda: versions["shout"].number == 2, "version 2 serving")
            assert await ask() == ("HEY?", versions["shout"].tag)
            assert f"reloaded shout.py: shout version {versions['shout'].tag} serves" in caplog.messages

            script.write_text(_shout("boom"))  # its setup() raises: the new worker never serves
            await _until(lambda: len(errors()) == 1, "the failed start logged")
            assert errors()[0].startswith(f"reloading shout.py failed, shout version {versions['shout'].tag} serves on: ")
            assert "no mark called boom" in errors()[0] and "\n" not in errors()[0]
            assert await ask() == ("HEY?", versions["shout"].tag) and versions["shout"].number == 2

            script.write_text(_shout("?", after=" +"))  # a syntax error
            await _until(lambda: len(errors()) == 2, "the syntax error logged")
            assert errors()[1].endswith("shout.py, line 21: SyntaxError: invalid syntax"), errors()[1]
            assert await ask() == ("HEY?", versions["shout"].tag) and versions["shout"].number == 2

            script.write_text(_shout("?", after=' + "."'))  # fixed, and changed after the call
            await _until(lambda: versions["shout"].number == 3, "version 3 serving")
            assert await ask() == ("HEY?.", versions["shout"].tag)
        finally:
            await asyncio.to_thread(reloader.stop)
            await server.close()
        assert not reloader._thread.is_alive()

    asyncio.run(body())


# -- the real command ---------------------------------------------------------------------------------------------
def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as reply:  # noqa: S310 - the local test server
        return json.loads(reply.read())


def _query(url: str, path: str, **inputs: Any) -> tuple[Any, str]:
    request = urllib.request.Request(url + path, data=json.dumps({"inputs": inputs}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as reply:  # noqa: S310 - the local test server
        return json.loads(reply.read())["output"], reply.headers["X-Pipeline-Version"]


def _listed(url: str) -> dict[str, dict[str, Any]]:
    return {row["name"]: row for row in _get(url + "/v1/pipelines")["pipelines"]}


def _children(pid: int) -> set[int]:
    return {int(p) for task in Path(f"/proc/{pid}/task").iterdir() for p in (task / "children").read_text().split()}


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(0.1)


@pytest.mark.slow
def test_serve_two_scripts_each_by_name(tmp_path: Path) -> None:
    (tmp_path / "gen.py").write_text(GENERATE)
    (tmp_path / "lookup.py").write_text(LOOKUP)
    with serve_cli(tmp_path, "answer=gen.py", "lookup.py") as (server, url, _):
        listed = _listed(url)
        assert sorted(listed) == ["answer", "lookup"]
        assert {name: (row["version"], row["inputs"], row["state"]) for name, row in listed.items()} == {
            "answer": (1, ["question"], "ready"), "lookup": (1, ["key"], "ready")}
        output, version = _query(url, "/v1/pipelines/answer/query", question="what is a loop?")
        assert (output, version) == ("G: what is a loop?", f"1-{listed['answer']['digest']}")
        output, _ = _query(url, "/v1/pipelines/lookup/query", key="generators")
        assert output == {"title": "generators", "text": "A generator function yields values lazily."}
        with pytest.raises(urllib.error.HTTPError) as refused:
            _query(url, "/v1/query", question="which one?")
        assert refused.value.code == 400 and "serves several pipelines (answer, lookup)" in refused.value.read().decode()
        assert len(_children(server.pid)) == 2  # a worker per component


@pytest.mark.slow
def test_serve_the_pipelines_of_a_config_file(tmp_path: Path) -> None:
    (tmp_path / "gen.py").write_text(GENERATE)
    (tmp_path / "shoutapp").mkdir()
    (tmp_path / "shoutapp" / "__init__.py").write_text("")
    (tmp_path / "shoutapp" / "main.py").write_text(_shout("!"))
    (tmp_path / "deploy.yaml").write_text(textwrap.dedent("""\
        log_level: info
        pipelines:
          answer: gen.py
          loud: {target: "shoutapp.main:pipeline"}
        components:
          shout: {replicas: 2}
    """))
    with serve_cli(tmp_path, "--config", "deploy.yaml") as (server, url, _):
        assert sorted(_listed(url)) == ["answer", "loud"]
        assert _query(url, "/v1/pipelines/loud/query", text="hey")[0] == "HEY!"
        assert _query(url, "/v1/pipelines/answer/query", question="a question")[0] == "G: a question"
        plan = _get(url + "/v1/plan")
        assert plan["components"]["shout"]["replicas"] == 2 and plan["components"]["generator"]["replicas"] == 1
        assert len(_children(server.pid)) == 3


@pytest.mark.slow
def test_serve_reload_serves_an_edited_script_and_keeps_it_through_a_broken_one(tmp_path: Path) -> None:
    script = tmp_path / "shout.py"
    script.write_text(_shout("!"))
    (tmp_path / "gen.py").write_text(GENERATE)
    with serve_cli(tmp_path, "shout.py", "gen.py", "--reload") as (server, url, log):
        workers = _children(server.pid)
        assert _query(url, "/v1/pipelines/shout/query", text="hey")[0] == "HEY!"

        script.write_text(_shout("!", after=' + " (v2)"'))  # only the code after the call changes
        _wait_for(lambda: _listed(url)["shout"]["version"] == 2, "version 2 listed")
        output, version = _query(url, "/v1/pipelines/shout/query", text="hey")
        assert output == "HEY! (v2)" and version.startswith("2-")
        assert re.search(rf"INFO patchkit.reload: reloaded shout.py: shout version {version} serves$", log.read_text(), re.M)
        assert _children(server.pid) == workers  # the component did not change: its worker serves on
        assert _listed(url)["gen"]["version"] == 1

        script.write_text(_shout("!", after=" +"))
        _wait_for(lambda: "ERROR" in log.read_text(), "the failed reload logged")
        [line] = [line for line in log.read_text().splitlines() if "ERROR" in line]
        assert line.endswith(f"ERROR patchkit.reload: reloading shout.py failed, shout version {version} serves on: "
                             "shout.py, line 21: SyntaxError: invalid syntax"), line
        assert _query(url, "/v1/pipelines/shout/query", text="hey") == ("HEY! (v2)", version)
        assert _listed(url)["shout"]["version"] == 2
