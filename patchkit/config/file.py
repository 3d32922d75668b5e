"""The config file of `patchkit serve --config deploy.yaml`: every deploy option, and options per component.

    slo_ms: 2000
    backend: local
    components:
      llm: {replicas: 2, batch_size: {generate: 8}, min_replicas: 1, max_replicas: 4}

The schema is a pydantic model: its top-level options are made from the options' field metadata
(patchkit/config/options.py: their types, defaults, bounds, choices and help), so the file takes every option
`deploy()` does and checks each as deploy() does; `components` holds a
`ComponentOptions` per component. YAML, JSON or TOML, by the file's suffix. `load` reports every problem at
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
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, create_model

from patchkit.config import OPTIONS, OptionSpec
from patchkit.config.options import check_value
from patchkit.errors import ConfigError

__all__ = ["ComponentOptions", "ServeFile", "describe", "deploy_arguments", "given", "keys", "load", "markdown_table", "schema"]

STRICT = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
# The keys that are no deploy() option.
FILE_ONLY = ("replicas", "batch_size", "plan", "resources", "components")
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


class _FileOnly(BaseModel):
    """The keys besides deploy()'s options: sizing every component at once, planning, and `components`."""

    model_config = STRICT
    replicas: Count | None = Field(None, description="replicas of every component (default 1)")
    batch_size: Count | None = Field(None, description="batch size of every method (default: the method's own)")
    plan: str | None = Field(None, description="'auto' to plan first, or a plan file `patchkit plan --json` wrote")
    resources: dict[str, Count] | None = Field(None, description="with plan: auto, the pool, as {cpu: 8, gpu: 2}")
    components: dict[str, ComponentOptions] = Field({}, description="options by component name (see below)")


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
    """The keys the schema allows at a path: the top level, or one component's."""
    if len(loc) == 2 and loc[0] == "components":
        return set(ComponentOptions.model_fields)
    return set(ServeFile.model_fields)


# -- onto deploy()'s arguments --------------------------------------------------------------------------------------
def given(settings: BaseModel) -> dict[str, Any]:
    """The keys the file sets, and the command line's defaults for those it leaves out."""
    return {**SERVE_DEFAULTS, **settings.model_dump(exclude_unset=True)}


def deploy_arguments(values: Mapping[str, Any], components: Iterable[str]) -> dict[str, Any]:
    """`values` (the file's keys, command-line flags applied) as `DeploymentConfig.resolve`'s arguments for a
    pipeline with these components: per-component options merged into the by-name forms resolve takes.

    Raises ConfigError for a component name the pipeline does not have, with the closest one.
    """
    names = list(components)
    arguments = {k: v for k, v in values.items() if k not in ("components", "resources")}
    per_component: Mapping[str, Mapping[str, Any]] = values.get("components") or {}
    for name in per_component:
        if name not in names:
            close = difflib.get_close_matches(name, names, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"components names {name!r}, which the pipeline does not have{hint} (known: {', '.join(names)})")
    for key in ("replicas", "min_replicas", "max_replicas", "ray_actor_options"):
        own = {name: options[key] for name, options in per_component.items() if options.get(key) is not None}
        if own:
            everyone = arguments.get(key)
            base = dict(everyone) if isinstance(everyone, Mapping) else dict.fromkeys(names, everyone) if everyone else {}
            arguments[key] = {**base, **own}
    sizes = {}
    for name, options in per_component.items():
        size = options.get("batch_size")
        if isinstance(size, Mapping):
            sizes.update({f"{name}.{method}": count for method, count in size.items()})
        elif size is not None:
            sizes[name] = size
    if sizes:
        everyone = arguments.get("batch_size")
        arguments["batch_size"] = {**(dict.fromkeys(names, everyone) if everyone else {}), **sizes}
    if "optional_inputs" in arguments:
        arguments["optional_inputs"] = tuple(arguments["optional_inputs"])
    return arguments


def keys(model: type[BaseModel] = ServeFile) -> list[tuple[str, Any, str]]:
    """Every key of `model` (the file's top level, or ComponentOptions) but `components`, as (name, default, help),
    the default the one `patchkit serve` applies (None where there is none). What `describe` and `markdown_table`
    render, so that `--help`, the documentation and the schema list the same keys."""
    rows = []
    for name, info in model.model_fields.items():
        if name == "components":
            continue
        default = info.default if model is ComponentOptions else SERVE_DEFAULTS.get(name, info.default)
        rows.append((name, None if default == [] or default == {} else default, str(info.description)))
    return rows


def describe(model: type[BaseModel] = ServeFile) -> str:
    """The file's keys, for `patchkit serve --help`."""
    lines = ["config file (--config deploy.yaml, .json or .toml; flags given on the command line win):"]
    lines += _key_lines(keys(model))
    lines.append("  components: {NAME: {...}}   per component, overriding the keys above of the same name:")
    lines += _key_lines(keys(ComponentOptions), indent="    ")
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
    return "\n".join(lines)


def _table_row(key: str, default: Any, text: str) -> str:
    shown = "" if default is None else f"`{json.dumps(default)}`"
    escaped = text.replace("|", "\\|")  # a bar would end the cell
    return f"| {key} | {shown} | {escaped} |"
