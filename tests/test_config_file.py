"""`patchkit serve --config FILE` and `patchkit serve module:attribute`.

Every kind of key reaches the DeploymentConfig it should; YAML, JSON and TOML read the same; unknown keys
and bad values are one line each, with the key's path and a suggestion; flags override the file; a
module's Pipeline is found, or a clear error says why not; and a real `patchkit serve --config` answers.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from serving import serve_cli

import patchkit
from patchkit import Component, ConfigError, make
from patchkit.cli.commands import main, parser, serve_settings
from patchkit.cli.targets import import_pipeline
from patchkit.config import OPTIONS, DeploymentConfig
from patchkit.config import file as cf

ROOT = Path(__file__).resolve().parent.parent


class Retriever(Component):
    @make
    def retrieve(self, query: str) -> list[str]:
        return [query]

    @make
    def lookup(self, key: str) -> str:
        return key


class Llm(Component):
    @make
    def generate(self, query: str, docs: list[str]) -> str:
        return query + str(docs)


def _pipeline() -> patchkit.Pipeline:
    retriever, llm = Retriever(), Llm()
    query = "q"
    with patchkit.capture(run=False) as pipeline:
        answer = llm.generate(query, retriever.retrieve(query))  # noqa: F841 - the output
    return pipeline


def _write(tmp_path: Path, text: str, name: str = "deploy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _config(path: Path, *flags: str) -> DeploymentConfig:
    """What `patchkit serve pipeline.py --config PATH FLAGS` would deploy, for the pipeline above."""
    pipeline = _pipeline()
    values = serve_settings(parser().parse_args(["serve", "pipeline.py", "--config", str(path), *flags]))
    return DeploymentConfig.resolve(pipeline, **cf.deploy_arguments(values, pipeline.components))


FULL = """\
    backend: inprocess
    host: 127.0.0.2
    port: 0
    slo_ms: 1500
    batch_wait_ms: 2.5
    pipelining: false
    max_inflight_requests: 100
    request_timeout_s: 20
    debug: true
    log_level: warning
    optional_inputs: [query]
    estimator: average
    pause_admission: true
    replicas: 2
    batch_size: 4
    max_replicas: 6
    components:
      llm: {replicas: 3, batch_size: {generate: 8}, min_replicas: 2}
      retriever: {batch_size: 16, max_replicas: 5}
"""


def test_every_kind_of_key_reaches_the_deployment(tmp_path: Path) -> None:
    config = _config(_write(tmp_path, FULL))
    assert (config.backend, config.server.host, config.server.port, config.slo.slo_ms, config.limits.batch_wait_ms) == (
        "inprocess", "127.0.0.2", 0, 1500, 2.5)
    assert (config.limits.pipelining, config.limits.max_inflight_requests, config.liveness.request_timeout_s,
            config.server.debug) == (False, 100, 20, True)
    assert (config.server.log_level, config.server.optional_inputs, config.slo.pause_admission) == ("WARNING", ("query",), True)
    assert config.components["llm"].replicas == 3 and config.components["retriever"].replicas == 2  # own, else everyone's
    assert config.components["llm"].batch_sizes == {"generate": 8}
    assert config.components["retriever"].batch_sizes == {"retrieve": 16, "lookup": 16}
    assert config.min_replicas_of("llm") == 2 and config.min_replicas_of("retriever") == 2  # as deployed
    assert config.max_replicas_of("llm") == 6 and config.max_replicas_of("retriever") == 5


def test_per_method_batch_sizes_leave_the_others_at_the_top_level_size(tmp_path: Path) -> None:
    config = _config(_write(tmp_path, "batch_size: 4\ncomponents:\n  retriever: {batch_size: {lookup: 2}}\n"))
    assert config.components["retriever"].batch_sizes == {"retrieve": 4, "lookup": 2}
    assert config.components["llm"].batch_sizes == {"generate": 4}


def test_ray_actor_options_by_component(tmp_path: Path) -> None:
    text = """\
        backend: ray
        ray_actor_options: {retriever: {num_cpus: 2}}
        components:
          llm: {ray_actor_options: {num_gpus: 1, num_cpus: 1}}
    """
    config = _config(_write(tmp_path, text))
    assert config.ray.actor_options == {"retriever": {"num_cpus": 2}, "llm": {"num_gpus": 1, "num_cpus": 1}}


def test_json_and_toml_read_as_yaml_does(tmp_path: Path) -> None:
    data = {"slo_ms": 900, "batch_wait_ms": 1.0, "components": {"llm": {"replicas": 2, "batch_size": {"generate": 4}}}}
    toml = 'slo_ms = 900\nbatch_wait_ms = 1.0\n[components.llm]\nreplicas = 2\nbatch_size = {generate = 4}\n'
    yaml_text = "slo_ms: 900\nbatch_wait_ms: 1.0\ncomponents:\n  llm: {replicas: 2, batch_size: {generate: 4}}\n"
    made = [_config(_write(tmp_path, json.dumps(data), "d.json")), _config(_write(tmp_path, toml, "d.toml")),
            _config(_write(tmp_path, yaml_text, "d.yml"))]
    assert made[0] == made[1] == made[2]
    assert made[0].slo.slo_ms == 900 and made[0].components["llm"].replicas == 2


def test_every_deploy_option_is_a_key_with_help() -> None:
    assert set(OPTIONS) <= set(cf.ServeFile.model_fields)
    assert all(cf.ServeFile.model_fields[name].description == spec.option.help for name, spec in OPTIONS.items())
    text = cf.describe()
    for key in [*cf.ServeFile.model_fields, *cf.ComponentOptions.model_fields]:
        assert re.search(rf"^\s+{key}[\s:]+\S", text, re.MULTILINE), key


def test_serve_help_lists_the_config_keys(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    assert "--config FILE" in shown and "module:attribute" in shown
    assert re.search(r"^  request_timeout_s\s+a request still running after this gets 504 \(default 300.0\)$", shown, re.M)
    assert re.search(r"^    min_replicas\s+the fewest replicas autoscaling leaves$", shown, re.M)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("components:\n  llm: {replica: 2}\n", "unknown key 'replica' in components.llm; did you mean 'replicas'?"),
        ("slo: 100\n", "unknown key 'slo' at the top level; did you mean 'slo_ms'?"),
        ("zzzz: 1\n", "unknown key 'zzzz' at the top level (known: "),
        ("port: eighty\n", "port should be a valid integer; got 'eighty'"),
        ("port: 70000\n", "port should be less than or equal to 65535; got 70000"),
        ("slo_ms: [1]\n", "slo_ms must be a number of milliseconds or a dict of them by pipeline name; got [1]"),
        ("request_timeout_s: 0\n", "request_timeout_s should be greater than 0; got 0"),
        ("request_timeout_s: .nan\n", "request_timeout_s should be a finite number; got nan"),
        ("debug: maybe\n", "debug should be a valid boolean; got 'maybe'"),
        ("backend: lokal\n", "backend should be 'local', 'inprocess' or 'ray'; got 'lokal'; did you mean 'local'?"),
        ("optional_inputs: query\n", "optional_inputs must be a list of input names, such as ['topk']; got 'query'"),
        ("max_replicas: {llm: 0}\n", "max_replicas['llm'] must be >= 1; got 0"),
        ("host: ' '\n", "host must be an address to listen on, such as '127.0.0.1' or '0.0.0.0'; got ' '"),
        ("log_level: loud\n", "log_level must be one of 'debug', 'info', 'warning', 'error', 'critical'; got 'loud'"),
        ("components:\n  llm: {replicas: 0}\n", "components.llm.replicas should be greater than or equal to 1; got 0"),
        ("components:\n  llm: {batch_size: {generate: two}}\n", "components.llm.batch_size must be an integer >= 1, or such"),
        ("components:\n  llm: {ray_actor_options: 3}\n", "components.llm.ray_actor_options should be a valid dictionary"),
        ("components:\n  llm: 3\n", "components.llm should be a valid dictionary"),
    ],
)
def test_a_bad_key_or_value_is_one_line_naming_its_path(tmp_path: Path, text: str, line: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as raised:
        cf.load(path)
    assert str(raised.value).startswith(f"{path}: {line}"), str(raised.value)


def test_files_that_are_no_mapping_or_no_format_are_refused(tmp_path: Path) -> None:
    for name, text, message in [("d.yaml", "- 1\n", "must hold a mapping"), ("d.yaml", "a: [1\n", "not valid YAML"),
                                ("d.json", "{", "not valid JSON"), ("d.toml", "a = ", "not valid TOML"),
                                ("d.ini", "a=1", "a config file is .yaml, .yml, .json or .toml")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            cf.load(_write(tmp_path, text, name))
    with pytest.raises(ConfigError, match="cannot be read"):
        cf.load(tmp_path / "missing.yaml")
    assert cf.load(_write(tmp_path, "")).model_dump(exclude_unset=True) == {}


def test_an_unknown_component_gets_the_closest_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"components names 'lm', which the pipeline does not have; did you mean 'llm'\?"):
        _config(_write(tmp_path, "components:\n  lm: {replicas: 2}\n"))
    with pytest.raises(ConfigError, match=r"batch_size names 'llm.generat'.*did you mean 'llm.generate'\?"):
        _config(_write(tmp_path, "components:\n  llm: {batch_size: {generat: 2}}\n"))


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, FULL)
    config = _config(path, "--replicas", "2", "--batch-size", "2", "--port", "9", "--slo-ms", "700", "--log-level", "error",
                     "--backend", "inprocess")
    assert (config.server.port, config.slo.slo_ms, config.server.log_level) == (9, 700, "ERROR")
    assert {c.replicas for c in config.components.values()} == {2}  # the flag beats the components' own too
    assert config.components["llm"].batch_sizes == {"generate": 2}
    assert config.max_replicas_of("retriever") == 5 and config.liveness.request_timeout_s == 20  # the rest as the file says
    config = _config(_write(tmp_path, "slo_ms: 100\n"))
    assert (config.server.port, config.server.log_level, config.server.host) == (8000, "INFO", "127.0.0.1")  # serve's own


@pytest.mark.slow
def test_problems_print_one_line_each_and_exit_2(tmp_path: Path) -> None:
    path = _write(tmp_path, "slo: 1\ncomponents:\n  llm: {replica: 2, batch_size: 0}\n")
    done = subprocess.run([sys.executable, "-m", "patchkit.cli", "serve", "nowhere.py", "--config", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert sorted(lines) == sorted([
        f"patchkit serve: {path}: unknown key 'slo' at the top level; did you mean 'slo_ms'?",
        f"patchkit serve: {path}: unknown key 'replica' in components.llm; did you mean 'replicas'?",
        f"patchkit serve: {path}: components.llm.batch_size must be an integer >= 1, or such integers by method name, "
        "such as {generate: 8}; got 0",
    ]), done.stderr


APP = '''
import patchkit
from patchkit import Component, make


class Shout(Component):
    @make
    def shout(self, text: str) -> str:
        return text.upper() + "!"


shout = Shout()
text = "hi"
with patchkit.capture(run=False) as pipeline:
    answer = shout.shout(text)
not_a_pipeline = 3
'''


@pytest.fixture
def app_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "shoutapp").mkdir()
    (tmp_path / "shoutapp" / "__init__.py").write_text("")
    (tmp_path / "shoutapp" / "main.py").write_text(APP)
    (tmp_path / "broken.py").write_text("import no_such_dependency_here\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in [n for n in sys.modules if n.startswith("shoutapp")]:
        monkeypatch.delitem(sys.modules, name)
    return tmp_path


def test_module_attribute_names_a_pipeline(app_dir: Path) -> None:
    pipeline = import_pipeline("shoutapp.main:pipeline")
    assert isinstance(pipeline, patchkit.Pipeline) and pipeline(text="yo") == "YO!"


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("shoutapp.nope:pipeline", "no module named 'shoutapp.nope'"),
        ("nowhere:pipeline", "no module named 'nowhere'"),
        ("shoutapp.main:pipelin", "shoutapp.main has no attribute 'pipelin'; did you mean 'pipeline'?"),
        ("shoutapp.main:pipeline.x", "shoutapp.main.pipeline has no attribute 'x'"),
        ("shoutapp.main:not_a_pipeline", "shoutapp.main:not_a_pipeline is a int, not a Pipeline"),
        ("shoutapp.main:", "name a pipeline as module:attribute"),
    ],
)
def test_module_attribute_errors_say_what_is_missing(app_dir: Path, target: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        import_pipeline(target)


def test_a_module_missing_a_dependency_raises_as_python_does(app_dir: Path) -> None:
    with pytest.raises(ModuleNotFoundError, match="no_such_dependency_here"):
        import_pipeline("broken:pipeline")


@pytest.mark.slow
def test_serve_with_a_config_file_end_to_end(app_dir: Path) -> None:
    """`patchkit serve shoutapp.main:pipeline --config deploy.yaml` on worker processes, queried, then stopped."""
    _write(app_dir, "port: 0\nslo_ms: 5000\ncomponents:\n  shout: {replicas: 2, batch_size: 4}\n")
    with serve_cli(app_dir, "shoutapp.main:pipeline", "--config", "deploy.yaml", "--log-level", "warning") as (_, url, _):
        request = urllib.request.Request(url + "/v1/query", data=json.dumps({"inputs": {"text": "hey"}}).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as reply:  # noqa: S310 - the local test server
            assert json.loads(reply.read())["output"] == "HEY!"
        with urllib.request.urlopen(url + "/v1/plan", timeout=30) as reply:  # noqa: S310
            plan: dict[str, Any] = json.loads(reply.read())
        assert plan["slo_ms"] == 5000 and plan["log_level"] == "WARNING"
        assert plan["components"]["shout"]["replicas"] == 2 and plan["components"]["shout"]["batch_sizes"] == {"shout": 4}
