"""The config file of `patchkit serve --config deploy.yaml`: every deploy option, options per component, and
the pipelines to serve with options per pipeline.

    slo_ms: 2000
    backend: local
    components:
      llm: {replicas: 2, batch_size: {generate: 8}, min_replicas: 1, max_replicas: 4}
    pipelines:
      crag: examples/crag.py
      hyde: {target: "app.hyde:pipeline", slo_ms: 500, priority: 1, weight: 3}

The schema is a pydantic model: its top-level options are made from the options' field metadata
(patchkit/config/options.py: their types, defaults, bounds, choices and help), so the file takes every option
`deploy()` does and checks each as deploy() does; `components` holds a `ComponentOptions` per component,
`pipelines` a `PipelineOptions` per pipeline. YAML, JSON or TOML, by the file's suffix. `load` reports every problem at
once, one line each, naming the key's path: an unknown key with the closest known one, a value of the
wrong type or out of range with what is allowed. `keys` lists every key with its default and help: `describe`
renders them for `patchkit serve --help`, `markdown_table` for the documentation's table of options.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, get_args

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from patchkit.config import OPTIONS, OptionSpec
from patchkit.config.options import check_value
from patchkit.errors import ConfigError

__all__ = ["ComponentOptions", "PipelineOptions", "ServeFile", "deploy_arguments", "describe", "given", "keys", "load",
           "markdown_table", "plan_weights", "schema"]

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# The command line's own defaults where they differ from deploy()'s.
SERVE_DEFAULTS = {"port": 8000, "log_level": "info"}


def _batch_sizes(value: Any) -> Any:
    """A component's batch_size: an integer >= 1, or such integers by method name."""
    items = value.items() if isinstance(value, Mapping) else [(None, value)]
    if not all((key is None or isinstance(key, str)) and _is_count(count) for key, count in items):
        raise ValueError(f"must be an integer >= 1, or such integers by method name, such as {{generate: 8}}; got {value!r}")
    return value


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


Count = Annotated[int, Field(ge=1)]


class ComponentOptions(BaseModel):
    """`components: {NAME: ...}`: one component's options, each overriding the top-level one."""

    model_config = STRICT
    replicas: Count | None = Field(None, description="replicas to start")
    batch_size: Annotated[Any, AfterValidator(_batch_sizes)] = Field(
        None, description="the most calls one batch takes: one number, or by method ({generate: 8})")
    min_replicas: Count | None = Field(None, description="the fewest replicas autoscaling leaves")
    max_replicas: Count | None = Field(None, description="the most replicas autoscaling gives")
    ray_actor_options: dict[str, Any] | None = Field(None, description="Ray actor options (num_cpus, num_gpus, ...)")


def _target(value: Any) -> Any:
    """A pipeline given as its target alone (`crag: examples/crag.py`) is one with no options of its own."""
    return {"target": value} if isinstance(value, str) else value


def _nonblank(value: str) -> str:
    if not value.strip():
        raise ValueError("must be FILE.py or module:attribute, as on the command line; got a blank string")
    return value


class PipelineOptions(BaseModel):
    """`pipelines: {NAME: ...}`: one pipeline the deployment serves under NAME, and its own options; the target
    alone (`NAME: app.py`) is one with none."""

    model_config = STRICT
    target: Annotated[str, AfterValidator(_nonblank)] = Field(
        description="FILE.py or module:attribute, as `patchkit serve` takes on the command line")
    slo_ms: float | None = Field(None, gt=0, description="slo_ms for this pipeline's requests, over the top-level key")
    priority: int | None = Field(None, description="priority for this pipeline's requests, over the top-level key")
    weight: float | None = Field(None, ge=0, description="with plan: auto, its share of the requests against the others' "
                                 "(default 1)")


class _FileOnly(BaseModel):
    """The keys besides deploy()'s options: sizing every component at once, planning, `components` and `pipelines`."""

    model_config = STRICT
    replicas: Count | None = Field(None, description="replicas of every component (default 1)")
    batch_size: Count | None = Field(None, description="batch size of every method (default: the method's own)")
    plan: str | None = Field(None, description="'auto' to plan first, or a plan file `patchkit plan --json` wrote")
    resources: dict[str, Count] | None = Field(None, description="with plan: auto, the pool, as {cpu: 8, gpu: 2}")
    components: dict[str, ComponentOptions] = Field({}, description="options by component name (see below)")
    pipelines: dict[str, Annotated[PipelineOptions, BeforeValidator(_target)]] = Field(
        {}, description="the pipelines to serve by name, instead of targets on the command line (see below)")


# The keys that are no deploy() option.
FILE_ONLY = tuple(_FileOnly.model_fields)
# The deploy options a pipeline of `pipelines:` sets for itself, passed to deploy() by pipeline name.
PER_PIPELINE = tuple(name for name in PipelineOptions.model_fields if name in OPTIONS)
# The options a component of `components:` sets for itself, passed to deploy() by component name (its batch_size
# by component or method).
PER_COMPONENT = tuple(name for name in ComponentOptions.model_fields if name != "batch_size")


def _option_field(spec: OptionSpec) -> tuple[Any, Any]:
    """A deploy option as a pydantic field, from its metadata: its type made strict, its bounds and choices
    enforced, then the check deploy() runs (for the rules a type cannot say: text that is not blank, a list of
    names, counts by component)."""
    meta, hint, default = spec.option, spec.hint, spec.default
    if meta.check is not None:
        hint = Any  # a compound value: its check says what it may be, as deploy() does
    elif meta.choices and not meta.any_case:
        hint = Literal[meta.choices] | None if type(None) in get_args(hint) else Literal[meta.choices]
    if isinstance(default, tuple):
        default = list(default)  # YAML and JSON have lists, not tuples
    checked = Annotated[hint, AfterValidator(functools.partial(_deploy_check, spec))]  # type: ignore[valid-type]
    return checked, Field(default, description=meta.help, gt=meta.gt, ge=meta.ge, le=meta.le)


def _deploy_check(spec: OptionSpec, value: Any) -> Any:
    check_value(spec, value)  # a ConfigError is a ValueError: pydantic reports it as the key's problem
    return value


def schema(options: Mapping[str, OptionSpec]) -> type[BaseModel]:
    """The whole config file's model: the file-only keys, and a key per option (by flat name) made from its
    metadata. `ServeFile` is DeploymentConfig's."""
    fields: dict[str, Any] = {name: _option_field(spec) for name, spec in options.items()}
    return create_model("ServeFile", __base__=_FileOnly, __doc__="The whole config file.", **fields)


ServeFile = schema(OPTIONS)


# -- loading -------------------------------------------------------------------------------------------------------
def load(path: str | Path) -> BaseModel:
    """The file read and checked; raises ConfigError with one line per problem, each naming the file and the key."""
    path = Path(path)
    data = _parse(path)
    try:
        return ServeFile.model_validate(data)
    except ValidationError as exc:
        raise ConfigError("\n".join(f"{path}: {_problem(error)}" for error in exc.errors())) from None


def _parse(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"--config names {str(path)!r}, which cannot be read ({exc.strerror})") from None
    suffix = path.suffix.lower()
    try:
        if suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text)
        elif suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            raise ConfigError(f"{path}: a config file is .yaml, .yml, .json or .toml; got {suffix or 'no suffix'!r}")
    except (yaml.YAMLError, ValueError) as exc:  # tomllib's and json's errors are ValueErrors
        raise ConfigError(f"{path}: not valid {suffix[1:].upper()}: {' '.join(str(exc).split())}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the file must hold a mapping of options, such as `slo_ms: 2000`; got {type(data).__name__}")
    return data


def _problem(error: Mapping[str, Any]) -> str:
    """One pydantic error as a line a user can act on."""
    loc = [str(part) for part in error["loc"]]
    where = ".".join(loc)
    if error["type"] == "extra_forbidden":
        parent = loc[:-1]
        known = _keys_at(parent)
        close = difflib.get_close_matches(loc[-1], sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(sorted(known))})"
        place = f"in {'.'.join(parent)}" if parent else "at the top level"
        return f"unknown key {loc[-1]!r} {place}{hint}"
    message = str(error["msg"]).removeprefix("Value error, ").removeprefix("Input ")
    if error["type"] == "value_error" and message.startswith(loc[-1]):  # deploy()'s own check: it names the key
        return ".".join([*loc[:-1], message])
    if error["type"] == "literal_error":
        choices = re.findall(r"'([^']*)'", str(error.get("ctx", {}).get("expected", "")))
        close = difflib.get_close_matches(str(error["input"]), choices, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        return f"{where} {message}; got {error['input']!r}{hint}"
    if message.startswith("must be"):
        return f"{where} {message}"
    secret = len(loc) == 1 and loc[0] in OPTIONS and OPTIONS[loc[0]].option.secret
    return f"{where} {message}" if secret else f"{where} {message}; got {error['input']!r}"


def _keys_at(loc: list[str]) -> set[str]:
    """The keys the schema allows at a path: the top level, one component's or one pipeline's."""
    if len(loc) == 2 and loc[0] == "components":
        return set(ComponentOptions.model_fields)
    if len(loc) == 2 and loc[0] == "pipelines":
        return set(PipelineOptions.model_fields)
    return set(ServeFile.model_fields)


# -- onto deploy()'s arguments --------------------------------------------------------------------------------------
def given(settings: BaseModel) -> dict[str, Any]:
    """The keys the file sets, and the command line's defaults for those it leaves out."""
    return {**SERVE_DEFAULTS, **settings.model_dump(exclude_unset=True)}


def deploy_arguments(values: Mapping[str, Any], components: Iterable[str]) -> dict[str, Any]:
    """`values` (the file's keys, command-line flags applied) as `DeploymentConfig.resolve`'s arguments for a
    deployment with these components: per-component options merged into the by-name forms resolve takes, and
    the per-pipeline ones of `pipelines` (`PER_PIPELINE`) into options by pipeline name, each pipeline that
    sets none getting the top-level value.

    Raises ConfigError for a component name the deployment does not have, with the closest one.
    """
    names = list(components)
    arguments = {k: v for k, v in values.items() if k not in ("components", "resources", "pipelines")}
    per_component: Mapping[str, Mapping[str, Any]] = values.get("components") or {}
    for name in per_component:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"components names {name!r}, which the pipeline does not have{hint} (known: {', '.join(names)})")
    _merge_by_name(arguments, per_component, PER_COMPONENT, names)
    _merge_by_name(arguments, values.get("pipelines") or {}, PER_PIPELINE)
    sizes = {}
    for name, options in per_component.items():
        size = options.get("batch_size")
        if isinstance(size, Mapping):
            sizes.update({f"{name}.{method}": count for method, count in size.items()})
        elif size is not None:
            sizes[name] = size
    if sizes:
        arguments["batch_size"] = {**_by_name(arguments.get("batch_size"), names), **sizes}
    if "optional_inputs" in arguments:
        arguments["optional_inputs"] = tuple(arguments["optional_inputs"])
    return arguments


def _merge_by_name(arguments: dict[str, Any], own: Mapping[str, Mapping[str, Any]], keys: Iterable[str],
                   names: Iterable[str] | None = None) -> None:
    """Each of `keys` that an entry of `own` (options by component or pipeline name) sets, as that option by
    name: the entries' own values over the top-level one, which every other name in `names` (default: own's)
    keeps."""
    for key in keys:
        values = {name: options[key] for name, options in own.items() if options.get(key) is not None}
        if values:
            arguments[key] = {**_by_name(arguments.get(key), own if names is None else names), **values}


def _by_name(everyone: Any, names: Iterable[str]) -> dict[str, Any]:
    """A top-level option as values by name: as it is where it is by name already, else one value for each name."""
    if isinstance(everyone, Mapping):
        return dict(everyone)
    return {} if everyone is None else dict.fromkeys(names, everyone)


def plan_weights(values: Mapping[str, Any]) -> dict[str, float] | None:
    """The `weight`s of `pipelines` as `plan(..., weights=)` takes them (a pipeline without one weighs 1); None
    where none sets one (equal shares)."""
    pipelines: Mapping[str, Mapping[str, Any]] = values.get("pipelines") or {}
    if all(options.get("weight") is None for options in pipelines.values()):
        return None
    return {name: 1.0 if options.get("weight") is None else options["weight"] for name, options in pipelines.items()}


def keys(model: type[BaseModel] = ServeFile) -> list[tuple[str, Any, str]]:
    """Every key of `model` (the file's top level, ComponentOptions or PipelineOptions) but `components` and
    `pipelines`, as (name, default, help), the default the one `patchkit serve` applies (None where there is none).
    What `describe` and `markdown_table` render, so that `--help`, the documentation and the schema list the
    same keys."""
    rows = []
    for name, info in model.model_fields.items():
        if name in ("components", "pipelines"):
            continue
        default = None if info.is_required() else info.default
        if issubclass(model, _FileOnly):
            default = SERVE_DEFAULTS.get(name, default)
        rows.append((name, None if default == [] or default == {} else default, str(info.description)))
    return rows


def describe(model: type[BaseModel] = ServeFile) -> str:
    """The file's keys, for `patchkit serve --help`."""
    lines = ["config file (--config deploy.yaml, .json or .toml; flags given on the command line win):"]
    lines += _key_lines(keys(model))
    lines.append("  components: {NAME: {...}}   per component, overriding the keys above of the same name:")
    lines += _key_lines(keys(ComponentOptions), indent="    ")
    lines.append("  pipelines: {NAME: {...}}    the pipelines to serve, instead of targets on the command line; NAME: FILE.py "
                 "(or module:attribute) alone, or:")
    lines += _key_lines(keys(PipelineOptions), indent="    ")
    return "\n".join(lines)


def _key_lines(rows: list[tuple[str, Any, str]], indent: str = "  ") -> list[str]:
    return [f"{indent}{name:<24} {text}{'' if default is None else f' (default {json.dumps(default)})'}"
            for name, default, text in rows]


# The line of a documentation page that the MkDocs hook (docs/hooks/options.py) replaces with `markdown_table()`.
TABLE_MARKER = "<!-- the options table, made from patchkit/config/file.py -->"


def markdown_table(model: type[BaseModel] = ServeFile) -> str:
    """The file's keys as a Markdown table (key, default, what it sets): the documentation's table of options,
    made when the site is built. Each top-level key but the sizing ones is also a `deploy()` argument."""
    lines = ["| key | default | what it sets |", "| --- | --- | --- |"]
    lines += [_table_row(f"`{name}`", default, text) for name, default, text in keys(model)]
    lines += [_table_row(f"`components.NAME.{name}`", default, f"per component, over the top-level key: {text}")
              for name, default, text in keys(ComponentOptions)]
    lines.append(_table_row("`pipelines.NAME`", None, "a pipeline to serve under NAME, instead of targets on the command "
                            "line: its target (FILE.py or module:attribute) alone, or the keys below"))
    lines += [_table_row(f"`pipelines.NAME.{name}`", default, text) for name, default, text in keys(PipelineOptions)]
    return "\n".join(lines)


def _table_row(key: str, default: Any, text: str) -> str:
    shown = "" if default is None else f"`{json.dumps(default)}`"
    escaped = text.replace("|", "\\|")  # a bar would end the cell
    return f"| {key} | {shown} | {escaped} |"
