"""Inputs for a method the calibration runs never reached: what it is profiled with instead, and why.

A method the pipeline called before (the capture's eager run, a `pipeline(...)` call) counts in its
component's visits per request, but when the calibration inputs leave its branch untaken, the calls
the profiler is given hold none of it. Called by the profiler for each such method, `stand_in`
finds calls it can take, in this order:

1. its own calls recorded before the calibration: the values the pipeline passed it then;
2. the recorded calls of another method whose parameters (the ones without a default) have the same
   names and types, such as a `search(query: str)` beside a `retrieve(query: str)`;
3. those of a method whose parameters have the same types, in order, under other names, such as a
   `rewrite(question: str)` beside a `retrieve(query: str)`: the values passed by its names.

A method whose parameters carry no annotation matches by names only. The profiler warns (a log line
and a `PlanWarning`) naming the method and where its inputs came from: its profile is as good as
they are like the calls it will serve.
"""

from __future__ import annotations

import inspect
import logging
import typing
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from patchkit.capture.recorder import CallRecord
from patchkit.core import Call, Component, make_methods
from patchkit.errors import PlanError, PlanWarning
from patchkit.scheduler.offline.cache import digest

__all__ = ["StandIn", "stand_in", "stand_ins"]

logger = logging.getLogger(__name__)

LIMIT = 64  # calls taken, at most (the profiler keeps no more distinct calls of a method)


@dataclass(frozen=True)
class StandIn:
    """Calls a method can take, their recorded seconds, and where they came from, in words."""

    calls: list[Call]
    seconds: list[float]
    source: str


@dataclass(frozen=True)
class _Parameter:
    name: str
    kind: Any  # an annotation, or inspect.Parameter.empty


def stand_in(
    component: Component, name: str, method: str, records: Sequence[CallRecord], names: dict[str, str]
) -> StandIn | None:
    """Calls for `name.method` from `records` (every call the pipelines recorded, the calibration's
    first), by the rules of the module's docstring; None when no recorded call fits it. `names`: the
    deployed name of each component, by its uid."""
    own = [r for r in records if r.component._patchkit_spec.uid == component._patchkit_spec.uid and r.method == method]
    if own:
        return _taken((((r.args, r.kwargs), r.seconds) for r in own),
                      "its own calls recorded before the calibration (the capture's eager run or an earlier pipeline(...) call)")
    wanted = _parameters(component, method)
    if not wanted:
        return None
    for same_names in (True, False):
        for other, records_of in _by_method(records, names):
            record = records_of[0]
            if (other == (name, method)) or not _matches(wanted, _parameters(record.component, record.method), same_names):
                continue
            given = _parameters(record.component, record.method)
            moved = [(_moved(r, given, wanted), r.seconds) for r in records_of]
            kept = [(call, s) for call, s in moved if call is not None]
            if kept:
                how = "whose parameters are the same" if same_names else "whose parameters have the same types"
                return _taken(kept, f"the inputs of {other[0]}.{other[1]}, {how} ({_shown(given)})")
    return None


def stand_ins(
    component: Component, name: str, missing: list[str], records: Sequence[CallRecord], names: dict[str, str]
) -> dict[str, StandIn]:
    """Inputs for each of `missing`, methods of `name` that count in its visits (an earlier run called them) but
    that the calibration inputs never reached, each said in a warning (`stand_in` for the arguments). Raises a
    PlanError for one that no recorded call fits."""
    found = {}
    for method in missing:
        stand = stand_in(component, name, method, records, names)
        if stand is None:
            raise PlanError(
                f"no recorded inputs for {name}.{method}: the calibration inputs never reached it, and no call recorded "
                "of it or of a method with its parameters fits it; pass calibration=[{...}, ...] inputs to plan() or "
                "deploy() that reach it, or run the capture eagerly (capture(run=True)) on such inputs"
            )
        warn(name, method, stand)
        found[method] = stand
    return found


def warn(name: str, method: str, found: StandIn) -> None:
    """Say, in the log and as a `PlanWarning`, that `name.method` is profiled with stand-in inputs."""
    message = (f"{name}.{method} was never called on the calibration inputs; profiled with {found.source} "
               f"({len(found.calls)} call{'s' * (len(found.calls) != 1)}): pass calibration inputs that reach it "
               "for a profile of the calls it will serve")
    logger.warning("%s", message)
    warnings.warn(message, PlanWarning, stacklevel=2)


def _taken(pairs: Iterable[tuple[Call, float]], source: str) -> StandIn:
    """The distinct calls among `pairs`, in order, at most LIMIT, with their seconds."""
    calls: list[Call] = []
    seconds: list[float] = []
    seen: set[str] = set()
    for call, s in pairs:
        key = digest(call)
        if key not in seen and len(calls) < LIMIT:
            seen.add(key)
            calls.append(call)
            seconds.append(s)
    return StandIn(calls, seconds, source)


def _by_method(records: Sequence[CallRecord], names: dict[str, str]) -> list[tuple[tuple[str, str], list[CallRecord]]]:
    """The records of each (deployed name, method), in the order each first appears."""
    grouped: dict[tuple[str, str], list[CallRecord]] = {}
    for record in records:
        deployed = names.get(record.component._patchkit_spec.uid)
        if deployed is not None:
            grouped.setdefault((deployed, record.method), []).append(record)
    return list(grouped.items())


def _parameters(component: Component, method: str) -> tuple[_Parameter, ...]:
    """The parameters of `method` that have no default (after `self`), with their annotations as types;
    for a `@make(batch=True)` method, the type of one item (it is called with one)."""
    made = make_methods(type(component))[method]
    signature = inspect.signature(made.fn)
    try:
        hints = typing.get_type_hints(made.fn)
    except Exception:  # an annotation that does not resolve here: compare them as written
        hints = {}
    found = []
    for parameter in list(signature.parameters.values())[1:]:
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD) or parameter.default is not parameter.empty:
            continue
        kind = hints.get(parameter.name, parameter.annotation)
        if made.batch and kind is not parameter.empty:
            kind = _item(kind)
        found.append(_Parameter(parameter.name, kind))
    return tuple(found)


def _item(annotation: Any) -> Any:
    """The item type of a list annotation (`list[str]` -> str); anything else as it is."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    return args[0] if origin in (list, Sequence) and len(args) == 1 else annotation


def _matches(wanted: tuple[_Parameter, ...], given: tuple[_Parameter, ...], same_names: bool) -> bool:
    if len(wanted) != len(given):
        return False
    if same_names:
        return all(w.name == g.name and w.kind == g.kind for w, g in zip(wanted, given))
    typed = all(w.kind is not inspect.Parameter.empty for w in wanted)
    return typed and all(w.kind == g.kind for w, g in zip(wanted, given))


def _moved(record: CallRecord, given: tuple[_Parameter, ...], wanted: tuple[_Parameter, ...]) -> Call | None:
    """The values `record` passed to `given`, passed by the names of `wanted`; None when one is missing
    or not of its type."""
    made = make_methods(type(record.component))[record.method]
    try:
        bound = inspect.signature(made.fn).bind(record.component, *record.args, **record.kwargs)
    except TypeError:
        return None
    kwargs = {}
    for g, w in zip(given, wanted):
        if g.name not in bound.arguments:
            return None
        value = bound.arguments[g.name]
        if isinstance(w.kind, type) and not isinstance(value, w.kind):
            return None
        kwargs[w.name] = value
    return (), kwargs


def _shown(parameters: tuple[_Parameter, ...]) -> str:
    return ", ".join(p.name if p.kind is inspect.Parameter.empty else f"{p.name}: {_type_name(p.kind)}" for p in parameters)


def _type_name(kind: Any) -> str:
    return kind.__name__ if isinstance(kind, type) and not typing.get_args(kind) else str(kind).replace("typing.", "")
