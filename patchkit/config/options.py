"""What one deploy option is: its field's metadata, and the checks that metadata drives.

A group of options (groups.py) is a frozen dataclass whose every field is made by `option()`: its default,
its help line, its bounds (`gt`, `ge`, `le`), its choices, whether `GET /v1/plan` shows it (`described`), whether
`patchkit serve` takes it as a flag (`flag`). Those fields are the one source of every option's name, type,
default, bounds and help: `OptionGroup` checks them when a group is built, `file.py` makes the config file's
schema from them (and from it `patchkit serve --help` and the documentation's table), the command line's flags
are those marked `flag`, and `deploy()`'s docstring lists them. Adding an option is adding a field.
"""

from __future__ import annotations

import difflib
import itertools
import math
import numbers
import operator
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Union, cast, get_args, get_origin, get_type_hints

from patchkit.errors import ConfigError

__all__ = [
    "Option", "OptionGroup", "OptionSpec", "check_counts", "check_names", "check_value", "close_hint", "collect", "is_int",
    "option", "reference", "simple_type",
]

OPTION = "patchkit.option"  # the key of a field's metadata that holds its `Option`
# What each simple annotation's values are, in an error message.
KINDS: dict[type, str] = {int: "an integer", float: "a finite number", bool: "True or False", str: "a string"}


@dataclass(frozen=True)
class Option:
    """One option's metadata, as `option()` records it on its field."""

    help: str  # one line: `patchkit serve --help`, the documentation's table, deploy()'s docstring
    name: str | None = None  # the flat name users pass, where it is not the field's own (`ray_address`: ray.address)
    gt: float | None = None
    ge: float | None = None
    le: float | None = None
    choices: tuple[str, ...] = ()
    any_case: bool = False  # choices match whatever the case (log_level)
    nonempty: str | None = None  # a string must hold text: what it should be, for the message
    check: Callable[[str, Any], None] | None = None  # the rule of a compound value (a list, a dict): raises ConfigError
    # Shown by `GET /v1/plan` (`DeploymentConfig.describe`), or a function of the value giving what is shown
    # (None: nothing). Off unless asked for, so that no later option (a path, an address, a key) is served.
    described: bool | Callable[[Any], Any] = False
    secret: bool = False  # never in a repr, a plan or an error message
    flag: bool = False  # also a flag of `patchkit serve` (`--batch-wait-ms`), made from this metadata


def option(
    default: Any,
    *,
    help: str,  # the word argparse and pydantic use
    name: str | None = None,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    choices: tuple[str, ...] = (),
    any_case: bool = False,
    nonempty: str | None = None,
    check: Callable[[str, Any], None] | None = None,
    described: bool | Callable[[Any], Any] = False,
    secret: bool = False,
    flag: bool = False,
) -> Any:
    """A group's field that is a deploy option (see `Option` for what each argument records)."""
    meta = Option(help, name, gt, ge, le, choices, any_case, nonempty, check, described, secret, flag)
    return field(default=default, repr=not secret, metadata={OPTION: meta})


@dataclass(frozen=True)
class OptionSpec:
    """An option as the rest of patchkit sees it.

    Its flat `name`, where it lives (`config.<group>.<field>`; `group` None: a field of DeploymentConfig itself), its resolved
    type hint, default and metadata.
    """

    name: str
    group: str | None
    field: str
    hint: Any
    default: Any
    option: Option

    @property
    def path(self) -> str:
        """Where a reader finds it: `server.host`, `ray.address`, or `backend`."""
        return self.field if self.group is None else f"{self.group}.{self.field}"

    def value_of(self, config: object) -> Any:
        """Its value in a DeploymentConfig."""
        holder = config if self.group is None else getattr(config, self.group)
        return getattr(holder, self.field)


class OptionGroup:
    """The base of every group of options.

    Built frozen, each field checked by its metadata, then by the group's own rules (`check`), which name both values when two
    fields conflict.
    """

    # Set where the group's options belong to one backend: given for another, they are a mistake.
    backend: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        for spec in specs_of(type(self)):
            check_value(spec, getattr(self, spec.field))
        self.check()

    def check(self) -> None:
        """The group's rules between its fields, and its values made canonical; called once its fields passed."""


def specs_of(cls: type) -> tuple[OptionSpec, ...]:
    """The options of a group (or DeploymentConfig's own), in field order; every field of a group must be one."""
    if cls not in _SPECS:
        _SPECS[cls] = _specs(cls)
    return _SPECS[cls]


_SPECS: dict[type, tuple[OptionSpec, ...]] = {}


def _specs(cls: type) -> tuple[OptionSpec, ...]:
    hints = get_type_hints(cls)
    found = []
    for f in fields(cast(Any, cls)):
        meta = f.metadata.get(OPTION)
        if meta is None:
            if issubclass(cls, OptionGroup):
                raise TypeError(f"{cls.__name__}.{f.name} is no option(): every field of a group is an option")
            continue
        if meta.secret and meta.described:
            raise TypeError(f"{cls.__name__}.{f.name} is secret: GET /v1/plan may not show it")
        if _compound(hints[f.name]) and meta.check is None:
            raise TypeError(f"{cls.__name__}.{f.name} is a {hints[f.name]}: a compound option needs a check=")
        spec = OptionSpec(meta.name or f.name, None, f.name, hints[f.name], f.default, meta)
        if meta.flag:
            simple_type(spec)  # a flag takes one simple value: raises TypeError where it has none
        found.append(spec)
    return tuple(found)


def collect(config: type) -> tuple[dict[str, OptionSpec], dict[str, type[OptionGroup]]]:
    """Every option of a config class by flat name (its own fields' and its groups'), and its groups by field."""
    hints = get_type_hints(config)
    groups = {f.name: hints[f.name] for f in fields(cast(Any, config))
              if isinstance(hints[f.name], type) and issubclass(hints[f.name], OptionGroup)}
    found: dict[str, OptionSpec] = {}
    specs = [*specs_of(config), *(replace(s, group=g) for g, kind in groups.items() for s in specs_of(kind))]
    for spec in specs:
        if spec.name in found:
            raise TypeError(f"two options are named {spec.name!r}: {found[spec.name].path} and {spec.path}")
        found[spec.name] = spec
    return found, groups


# -- checks: each raises a ConfigError naming the option, its value, and what it may be ------------------------------
def check_value(spec: OptionSpec, value: object) -> None:
    """Check one option's value against its type and metadata; raises ConfigError.

    Called by every group as it is built, and by the config file's schema after its own checks.
    """
    meta, name = spec.option, spec.name
    got = "" if meta.secret else f"; got {value!r}"
    if meta.check is not None:
        if value is not None or not _optional(spec.hint):
            meta.check(name, value)
        return
    _check_type(spec, value, got)
    if value is None:
        return
    if any(bound is not None and not holds(value, bound) for bound, holds, _ in _bounds(meta)):
        raise ConfigError(f"{name} must be {_range(meta)}{got}")
    chosen = value.lower() if meta.any_case and isinstance(value, str) else value
    if meta.choices and chosen not in meta.choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, meta.choices))}{got}{close_hint(value, meta.choices)}")
    if meta.nonempty is not None and not cast(str, value).strip():
        raise ConfigError(f"{name} must be {meta.nonempty}{got}")


def _bounds(meta: Option) -> tuple[tuple[float | None, Callable[[Any, Any], bool], str], ...]:
    return (meta.gt, operator.gt, ">"), (meta.ge, operator.ge, ">="), (meta.le, operator.le, "<=")


def _range(meta: Option) -> str:
    """The bounds as a message says them: `> 0`, `>= -1`, `in 0..65535`, `> 0 and <= 60`."""
    if meta.ge is not None and meta.le is not None:
        return f"in {meta.ge:g}..{meta.le:g}"
    return " and ".join(f"{sign} {bound:g}" for bound, _, sign in _bounds(meta) if bound is not None)


def _check_type(spec: OptionSpec, value: object, got: str) -> None:
    kinds = [kind for kind in _parts(spec.hint) if kind is not type(None)]
    if value is None and _optional(spec.hint):
        return
    if any(_is_kind(value, kind) for kind in kinds):
        return
    wanted = " or ".join(KINDS[kind] for kind in kinds) + (" or None" if _optional(spec.hint) else "")
    raise ConfigError(f"{spec.name} must be {wanted}{got}")


def _is_kind(value: object, kind: type) -> bool:
    if kind is int:
        return is_int(value)
    if kind is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, kind)


def _parts(annotation: Any) -> Iterator[Any]:
    yield from get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)


def _optional(annotation: Any) -> bool:
    return type(None) in tuple(_parts(annotation))


def _compound(annotation: Any) -> bool:
    return any(kind is not type(None) and kind not in KINDS for kind in _parts(annotation))


def simple_type(spec: OptionSpec) -> type:
    """The simple type of an option's values (int, float, bool or str), None left out: a flag's `type=`."""
    kinds = [kind for kind in _parts(spec.hint) if kind in KINDS]
    if len(kinds) != 1:
        raise TypeError(f"{spec.name} has no one simple type: {spec.hint}")
    return cast(type, kinds[0])


def is_int(value: object) -> bool:
    """Whether `value` is an integer, and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def close_hint(given: object, known: Iterable[str]) -> str:
    """The end of an error message: "; did you mean 'NAME'?" with the known name closest to `given`, or nothing."""
    close = difflib.get_close_matches(str(given), sorted(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def check_counts(argument: str, value: object) -> None:
    """`replicas`, `batch_size`, `min_replicas`, `max_replicas`: None, an integer >= 1, or such integers by name."""
    if value is None:
        return
    items = value.items() if isinstance(value, Mapping) else [(None, value)]
    for key, count in items:
        where = argument if key is None else f"{argument}[{key!r}]"
        if not is_int(count):
            by_name = "" if key is not None else " or a dict of them by name"
            raise ConfigError(f"{where} must be an integer >= 1{by_name}; got {count!r}")
        if cast(int, count) < 1:
            raise ConfigError(f"{where} must be >= 1; got {count!r}")


def check_targets(argument: str, value: object) -> None:
    """`slo_ms`: None, a number > 0, or such numbers by pipeline name."""
    if value is None:
        return
    for key, target in value.items() if isinstance(value, Mapping) else [(None, value)]:
        where = argument if key is None else f"{argument}[{key!r}]"
        if not isinstance(target, numbers.Real) or isinstance(target, bool):
            by_name = "" if key is not None else " or a dict of them by pipeline name"
            raise ConfigError(f"{where} must be a number of milliseconds{by_name}; got {target!r}")
        if not math.isfinite(float(target)):
            raise ConfigError(f"{where} must be a finite number or None; got {target!r}")
        if not float(target) > 0:
            raise ConfigError(f"{where} must be > 0; got {target!r}")


def check_priorities(argument: str, value: object) -> None:
    """`priority`: an integer, or integers by pipeline name."""
    for key, priority in value.items() if isinstance(value, Mapping) else [(None, value)]:
        if not is_int(priority):
            where = argument if key is None else f"{argument}[{key!r}]"
            raise ConfigError(f"{where} must be an integer (higher first); got {priority!r}")


def check_names(argument: str, value: object) -> None:
    """A list of names, such as optional_inputs: never one string, which would read as its letters."""
    if isinstance(value, str) or not isinstance(value, Iterable) or not all(isinstance(n, str) for n in value):
        raise ConfigError(f"{argument} must be a list of input names, such as ['topk']; got {value!r}")


def reference(specs: Iterable[OptionSpec], indent: str = "    ") -> str:
    """Every option, under its group's name, one line each with its help and default.

    The list that deploy()'s docstring ends with.
    """
    lines: list[str] = []
    for group, members in itertools.groupby(specs, key=lambda spec: spec.group):
        if group is not None:
            lines.append(f"{indent}{group}:")
        pad = indent if group is None else indent * 2
        for spec in members:
            default = "" if spec.default in (None, ()) else f" (default {spec.default!r})"
            lines.append(f"{pad}{spec.name}: {spec.option.help}{default}")
    return "\n".join(lines)
