"""A bad deploy() or `patchkit serve` option is a ConfigError where it is given: it names the option and
its value, suggests the closest name for a misspelt one, gives both values of a conflict, and comes
before anything is planned or started. The CLI prints it as one line and exits 2."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import patchkit
from patchkit import ConfigError, make
from patchkit.components.testing import Simulated
from patchkit.config import DeploymentConfig

ROOT = Path(__file__).resolve().parent.parent


def _one() -> patchkit.Pipeline:
    """x -> a.run"""
    a = Simulated(0)
    x = 1
    with patchkit.capture(run=False) as pipeline:
        answer = a.run(x)  # noqa: F841 - the block's output
    return pipeline


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_replica": 2}, "unknown option 'max_replica'; did you mean 'max_replicas'?"),
        ({"calibrations": []}, "unknown option 'calibrations'; did you mean 'calibration'?"),
        ({"replica": 2}, "unknown option 'replica'; did you mean 'replicas'?"),
        ({"zzz": 1}, r"unknown option 'zzz' \(help\(patchkit.deploy\) lists the options\)"),
        ({"slo_ms": -5}, "slo_ms must be > 0; got -5"),
        ({"slo_ms": math.nan}, "slo_ms must be a finite number or None; got nan"),
        ({"request_timeout_s": math.inf}, "request_timeout_s must be a finite number; got inf"),
        ({"max_inflight_requests": "10"}, "max_inflight_requests must be an integer; got '10'"),
        ({"max_inflight_requests": 0}, "max_inflight_requests must be > 0; got 0"),
        ({"drain_timeout_s": -1}, "drain_timeout_s must be >= 0; got -1"),
        ({"pipelining": "no"}, "pipelining must be True or False; got 'no'"),
        ({"port": 70000}, r"port must be in 0..65535; got 70000"),
        ({"backend": "rya"}, "backend must be one of 'local', 'inprocess', 'ray'; got 'rya'; did you mean 'ray'?"),
        ({"estimator": "xgb"}, "estimator must be one of 'average', 'xgboost'; got 'xgb'; did you mean 'xgboost'?"),
        ({"log_level": "inf"}, "log_level must be one of 'debug', .*; got 'inf'; did you mean 'info'?"),
        ({"replicas": 0}, "replicas must be >= 1; got 0"),
        ({"replicas": {"a": 1.5}}, r"replicas\['a'\] must be an integer >= 1; got 1.5"),
        ({"replicas": {"b": 2}}, "replicas names 'b', which the pipeline does not have"),
        ({"batch_size": {"a.rn": 2}}, "batch_size names 'a.rn', which the pipeline does not have; did you mean 'a.run'?"),
        ({"max_replicas": {"aa": 2}}, "max_replicas names 'aa', which the pipeline does not have; did you mean 'a'?"),
        ({"optional_inputs": "x"}, r"optional_inputs must be a list of input names, such as \['topk'\]; got 'x'"),
        ({"optional_inputs": ["y"]}, "optional_inputs names 'y', which the pipeline does not have"),
        ({"min_replicas": 3, "max_replicas": 2}, r"max_replicas \(2\) must be >= min_replicas \(3\)$"),
        ({"min_replicas": {"a": 3}, "max_replicas": 2}, r"max_replicas \(2\) must be >= min_replicas \(3\) for 'a'"),
        ({"plan": "Auto"}, "plan must be 'auto', a Plan, or None; got 'Auto'; did you mean 'auto'?"),
        ({"plan": "auto", "replicas": 2}, "either plan= or replicas=/batch_size=.*got plan='auto' and replicas=2"),
        ({"resources": {"cpu": 2}}, "resources= is for planning: pass it with plan='auto' .got plan=None."),
        ({"ray_address": "auto"}, "ray_address is an option of backend='ray'; got backend='local' and ray_address='auto'"),
        ({"backend": "ray", "tls": False, "tls_cert": "c.pem"}, "tls=False turns TLS off, but tls_cert='c.pem' asks for it"),
        ({"backend": "ray", "ray_max_restarts": -2}, "ray_max_restarts must be >= -1; got -2"),
        ({"backend": "ray", "ray_actor_options": [1]}, "ray_actor_options must map component names to Ray actor options"),
    ],
)
def test_a_bad_option_is_a_config_error_naming_it(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as raised:
        patchkit.deploy(_one(), **options)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, patchkit.PatchkitError)


class Profiled(patchkit.Component):
    """Raises if anything profiles or runs it: planning would."""

    def setup(self) -> None:
        raise RuntimeError("planned: the options were not checked first")

    @make
    def run(self, x: int) -> int:
        return x


def test_options_are_checked_before_planning() -> None:
    component = Profiled()
    x = 1
    with patchkit.capture(run=False) as pipeline:
        answer = component.run(x)  # noqa: F841 - the block's output
    for options in ({"replicas": 2}, {"max_inflight_requests": 0}, {"max_replica": 2}):
        with pytest.raises(ConfigError):
            patchkit.deploy(pipeline, plan="auto", calibration=[{"x": 1}], **options)


def test_a_deploy_argument_that_is_not_a_pipeline_is_named() -> None:
    with pytest.raises(ConfigError, match="deploy.. serves a Pipeline"):
        patchkit.deploy(lambda: 1)  # type: ignore[arg-type]


def test_an_environment_variable_that_is_no_number_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from patchkit import envs

    monkeypatch.setenv("PATCHKIT_WORKER_STOP_TIMEOUT_S", "-3")
    with pytest.raises(ConfigError, match="PATCHKIT_WORKER_STOP_TIMEOUT_S='-3' is not a number of seconds > 0"):
        envs.worker_stop_timeout_s()


@pytest.fixture
def patchkit_logger() -> Iterator[logging.Logger]:
    logger = logging.getLogger("patchkit")
    level = logger.level
    yield logger
    logger.setLevel(level)


def test_log_level_defaults_to_the_deploying_process_and_is_checked(patchkit_logger: logging.Logger) -> None:
    patchkit_logger.setLevel(logging.INFO)
    assert DeploymentConfig.resolve(_one()).server.log_level == "INFO"
    patchkit_logger.setLevel(15)  # a level between two: the one below, so that nothing asked for is lost
    assert DeploymentConfig.resolve(_one()).server.log_level == "DEBUG"
    patchkit_logger.setLevel(logging.INFO)
    assert DeploymentConfig.resolve(_one(), log_level="error").server.log_level == "ERROR"


def _serve(*arguments: str) -> subprocess.CompletedProcess[str]:
    script = ROOT / "examples" / "figure9.py"
    return subprocess.run([sys.executable, "-m", "patchkit.cli", "serve", str(script), *arguments],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arguments", "line"),
    [
        (("--slo-ms", "-5"), "patchkit serve: slo_ms must be > 0; got -5.0"),
        (("--port", "70000"), "patchkit serve: port must be in 0..65535; got 70000"),
        (("--replicas", "0"), "patchkit serve: replicas must be >= 1; got 0"),
        (("--plan", "missing.json"), "patchkit serve: --plan names 'missing.json', which cannot be read"),
    ],
)
def test_serve_prints_a_bad_option_as_one_line_and_exits_2(arguments: tuple[str, ...], line: str) -> None:
    done = _serve(*arguments)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(line), done.stderr


@pytest.mark.slow
def test_serve_takes_a_log_level() -> None:
    done = _serve("--log-level", "loud")
    assert done.returncode == 2 and "argument --log-level: invalid choice: 'loud'" in done.stderr
