"""Each option's field metadata is the one source of its name, type, default, bounds and help: deploy()'s checks,
the config file's schema, `patchkit serve --help`, the documentation's table, deploy()'s docstring and
`GET /v1/plan` all follow it, and every flat option users pass lands on its group's field."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic
import pytest

import patchkit
from patchkit import ConfigError
from patchkit.cli.commands import OPTION_FLAGS, main, parser
from patchkit.components.testing import Simulated
from patchkit.config import OPTIONS, DeploymentConfig, OptionSpec
from patchkit.config import file as cf
from patchkit.config.options import OptionGroup, collect, option, reference, simple_type, specs_of

# What `GET /v1/plan` served before the options had groups: the same flat keys, no more (no host, port, address,
# path, token or secret), so that clients reading it keep working.
DESCRIBED = {
    "backend", "slo_ms", "batch_wait_ms", "pipelining", "parallel_calls", "max_inflight_batches", "max_inflight_requests",
    "max_body_bytes", "max_inflight_bytes", "read_timeout_s", "request_timeout_s", "call_timeout_s", "abandoned_grace_s",
    "max_retries", "health_check_period_s", "health_check_timeout_s", "health_check_failures", "debug", "optional_inputs",
    "drain_timeout_s", "prioritize", "priority", "pause_admission", "admission_queue_limit", "estimator", "prefetch", "autoscale",
    "autoscale_interval_s", "scale_up_after_s", "scale_down_after_s", "min_replicas", "max_replicas", "plan",
    "ray_max_restarts", "ray_placement_timeout_s", "tls", "log_level", "name", "chat_input", "chat_output",
    "chat_drop_params", "components",
    "step_preview_chars", "steps", "fail_fast",
}


def _one() -> patchkit.Pipeline:
    a = Simulated(0)
    x = "1"
    with patchkit.capture(run=False) as pipeline:
        answer = a.run(x)  # noqa: F841 - the block's output
    return pipeline


def test_every_option_has_help_and_a_place() -> None:
    groups = {"server", "limits", "liveness", "slo", "autoscaling", "ray", "chat"}
    for name, spec in OPTIONS.items():
        assert spec.option.help.strip(), name
        assert spec.group in groups or (spec.group is None and name == "backend"), (name, spec.group)
        assert spec.path.split(".")[-1] == spec.field
    assert {spec.group for spec in OPTIONS.values()} - {None} == groups


def test_every_option_is_in_the_schema_the_help_the_table_and_the_docstring(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    shown = capsys.readouterr().out
    table, docstring = cf.markdown_table(), patchkit.deploy.__doc__ or ""
    for name, spec in OPTIONS.items():
        assert cf.ServeFile.model_fields[name].description == spec.option.help
        assert re.search(rf"^  {name}\s+{re.escape(spec.option.help)}", shown, re.M), name
        assert f"| `{name}` |" in table and spec.option.help.replace("|", "\\|") in table, name
        assert re.search(rf"^\s+{name}: {re.escape(spec.option.help)}", docstring, re.M), name


FLAG_VALUES = {"host": "0.0.0.0", "port": "9", "backend": "ray", "batch_wait_ms": "2.5", "slo_ms": "500", "log_level": "WARNING",
               "steps": "previews", "fail_fast": None}  # None: a switch (--fail-fast, --no-fail-fast)


def test_serve_flags_for_options_take_their_type_choices_and_help_from_the_metadata() -> None:
    root = parser()
    commands = next(action for action in root._actions if isinstance(action, argparse._SubParsersAction))
    flags = {action.dest: action for action in commands.choices["serve"]._actions}
    assert set(FLAG_VALUES) == set(OPTION_FLAGS)
    given = [word for name, value in FLAG_VALUES.items()
             for word in (f"--{name.replace('_', '-')}", *([] if value is None else [value]))]
    args = root.parse_args(["serve", "app.py", *given])
    for name in OPTION_FLAGS:
        spec = OPTIONS[name]
        assert (flags[name].help or "").startswith(spec.option.help), name
        assert flags[name].choices == (spec.option.choices or None), name
        assert isinstance(getattr(args, name), simple_type(spec)), name
    assert args.log_level == "warning"  # any case, as deploy() takes it


def _outside(spec: OptionSpec) -> Any:
    """A value of the option's type just past one of its bounds."""
    meta, kind = spec.option, simple_type(spec)
    if meta.le is not None:
        return kind(meta.le + 1)
    if meta.gt is not None:
        return kind(meta.gt)
    assert meta.ge is not None
    return kind(meta.ge - (1 if kind is int else 0.5))


BOUNDED = [spec for spec in OPTIONS.values() if {spec.option.gt, spec.option.ge, spec.option.le} != {None}]


@pytest.mark.parametrize("spec", BOUNDED, ids=[spec.name for spec in BOUNDED])
def test_bounds_are_enforced_by_deploy_and_by_the_file(spec: OptionSpec) -> None:
    value = _outside(spec)
    extra = {"backend": "ray"} if spec.group == "ray" else {}
    with pytest.raises(ConfigError, match=rf"^{spec.name} must be (>|>=|in) .*; got {re.escape(repr(value))}$"):
        DeploymentConfig.check_options({spec.name: value, **extra})
    with pytest.raises(pydantic.ValidationError) as raised:
        cf.ServeFile.model_validate({spec.name: value})
    assert [error["loc"] for error in raised.value.errors()] == [(spec.name,)]
    stated = _bounds_in(cf.ServeFile.model_json_schema()["properties"][spec.name])  # for editors that read the schema
    expected = {"exclusiveMinimum": spec.option.gt, "minimum": spec.option.ge, "maximum": spec.option.le}
    assert stated == {k: v for k, v in expected.items() if v is not None}


def _bounds_in(schema: Any) -> dict[str, Any]:
    found = {k: v for k, v in schema.items() if k in ("exclusiveMinimum", "minimum", "maximum")}
    for alternative in schema.get("anyOf", []):
        found.update(_bounds_in(alternative))
    return found


def test_choices_and_blank_text_are_refused_by_both() -> None:
    for name, value, message in [("estimator", "xgb", "estimator must be one of"), ("log_level", "loud", "log_level must be"),
                                 ("host", " ", "host must be an address"), ("chat_output", "", "chat_output must be a non")]:
        with pytest.raises(ConfigError, match=message):
            DeploymentConfig.check_options({name: value})
        with pytest.raises(pydantic.ValidationError):
            cf.ServeFile.model_validate({name: value})


def test_every_flat_option_lands_on_its_groups_field(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.write_text("cert")
    key.write_text("key")
    given: dict[str, Any] = {
        "backend": "ray", "host": "127.0.0.2", "port": 9, "read_timeout_s": 3.0, "auth_token": "t", "debug": True,
        "log_level": "ERROR", "steps": "off", "step_preview_chars": 12, "max_body_bytes": 10, "max_inflight_bytes": 20,
        "max_inflight_requests": 30,
        "max_inflight_batches": 4, "batch_wait_ms": 1.5, "pipelining": False, "parallel_calls": False,
        "request_timeout_s": 7.0,
        "call_timeout_s": 8.0, "abandoned_grace_s": 1.0, "max_retries": 0, "health_check_period_s": 2.0,
        "health_check_timeout_s": 4.0, "health_check_failures": 5, "drain_timeout_s": 0.0, "fail_fast": True,
        "slo_ms": 900.0,
        "prioritize": False, "priority": 2, "pause_admission": True, "admission_queue_limit": 6, "estimator": "xgboost",
        "prefetch": False,
        "autoscale": False, "autoscale_interval_s": 0.5, "scale_up_after_s": 0.0, "scale_down_after_s": 9.0,
        "min_replicas": 1, "max_replicas": {"a": 3}, "ray_address": "auto", "ray_max_restarts": -1,
        "ray_placement_timeout_s": 5.0, "ray_actor_options": {"a": {"num_cpus": 2}}, "tls": True, "tls_cert": str(cert),
        "tls_key": str(key), "tls_ca": str(cert), "tls_server_name": "worker", "name": "m", "chat_input": "x",
        "chat_output": "text", "chat_drop_params": ("logit_bias",),
    }
    assert set(given) == set(OPTIONS) - {"optional_inputs"}  # every option (optional_inputs is resolve's argument)
    config = DeploymentConfig.resolve(_one(), optional_inputs=["x"], **given)
    for name, value in {**given, "optional_inputs": ("x",)}.items():
        assert OPTIONS[name].value_of(config) == value, name
    assert config.ray.address == "auto" and config.chat.input == "x" and config.server.optional_inputs == ("x",)
    assert config.ray_options().tls_server_name == "worker" and config.ray_options().actor_options == {"a": {"num_cpus": 2}}


def test_describe_serves_the_same_flat_keys_and_never_a_secret() -> None:
    config = DeploymentConfig.resolve(_one(), auth_token="t0ken", secret="s3cret", port=9)
    described = config.describe()
    assert set(described) == DESCRIBED - {"ray_actor_options"}  # shown only when given
    assert described["request_timeout_s"] == 300.0 and described["chat_input"] is None
    assert "t0ken" not in repr(config) and "s3cret" not in repr(config) and "t0ken" not in str(described)


def test_a_secret_option_is_never_echoed_in_an_error() -> None:
    with pytest.raises(ConfigError) as raised:
        DeploymentConfig.check_options({"auth_token": 12345})
    assert str(raised.value) == "auth_token must be a string or None"


@dataclass(frozen=True)
class Warmup(OptionGroup):
    warmup_s: float = option(1.5, help="how long a new replica warms up before its first call", gt=0, le=60, described=True)


@dataclass(frozen=True)
class Bigger:
    """A config with one more group."""

    warmup: Warmup = field(default_factory=Warmup)


def test_an_option_with_metadata_reaches_the_checks_the_schema_the_table_and_the_docstring() -> None:
    """A new group, as a future option would come: nothing but its field says anything about it."""
    options, groups = collect(Bigger)
    assert groups == {"warmup": Warmup} and options["warmup_s"].path == "warmup.warmup_s"
    with pytest.raises(ConfigError, match=r"^warmup_s must be > 0 and <= 60; got 61$"):
        Warmup(warmup_s=61)
    with pytest.raises(ConfigError, match=r"^warmup_s must be > 0 and <= 60; got 0$"):
        Warmup(warmup_s=0)
    with pytest.raises(ConfigError, match=r"^warmup_s must be a finite number; got 'soon'$"):
        Warmup(warmup_s="soon")  # type: ignore[arg-type]
    model = cf.schema(options)
    assert model.model_validate({"warmup_s": 2}).warmup_s == 2  # type: ignore[attr-defined]
    for bad in (0, 61, "soon"):
        with pytest.raises(pydantic.ValidationError):
            model.model_validate({"warmup_s": bad})
    assert re.search(r"^  warmup_s\s+how long a new replica warms up before its first call \(default 1.5\)$",
                     cf.describe(model), re.M)
    assert "| `warmup_s` | `1.5` | how long a new replica warms up before its first call |" in cf.markdown_table(model)
    listed = reference(options.values())  # what deploy()'s docstring ends with
    assert listed == "    warmup:\n        warmup_s: how long a new replica warms up before its first call (default 1.5)"


def test_the_serve_flags_are_the_options_marked_flag_and_keys_of_the_file() -> None:
    """Marking an option `flag=True` is all it takes to make it a flag; every flag that is not the command's own
    is a config-file key, which it overrides."""
    root = parser()
    commands = next(action for action in root._actions if isinstance(action, argparse._SubParsersAction))
    dests = {action.dest for action in commands.choices["serve"]._actions} - {"help", "targets", "config", "reload"}
    assert dests <= set(cf.ServeFile.model_fields)
    assert {name for name in dests if name in OPTIONS} == {name for name, spec in OPTIONS.items() if spec.option.flag}
    assert set(OPTION_FLAGS) == {name for name, spec in OPTIONS.items() if spec.option.flag}


def test_a_flag_needs_one_simple_type() -> None:
    @dataclass(frozen=True)
    class Listed(OptionGroup):
        names: tuple[str, ...] = option((), help="names", check=lambda name, value: None, flag=True)

    with pytest.raises(TypeError, match="no one simple type"):
        specs_of(Listed)


def test_deploy_parameters_that_are_options_default_as_their_metadata_says() -> None:
    from inspect import Parameter, signature

    from patchkit.client.deploy import DEPLOY_ARGUMENTS

    for name, parameter in signature(patchkit.deploy).parameters.items():
        if name in OPTIONS:
            assert parameter.default == OPTIONS[name].default, name
        elif parameter.kind is not Parameter.VAR_KEYWORD:
            assert name in DEPLOY_ARGUMENTS, name
