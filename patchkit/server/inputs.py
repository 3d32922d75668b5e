"""The JSON edge of the front-end: request bodies checked against the pipeline's inputs, outputs to JSON.

An input's captured default fixes its JSON type: a str input takes a string, an int an integer,
a float any number, a tuple a list (turned back into a tuple), and so on. A value whose type JSON
cannot carry keeps its captured value and cannot be given by a request.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

from patchkit.errors import InputError, unknown_input

__all__ = ["InputSchema", "output_json"]

_JSON_TYPES: dict[type, str] = {str: "a string", bool: "true or false", int: "an integer", float: "a number"}


class InputSchema:
    """Checks `{"inputs": {...}, "slo_ms"?: n}` bodies; every input is required unless listed as optional."""

    def __init__(self, defaults: Mapping[str, Any], optional: tuple[str, ...] = ()) -> None:
        self.defaults = dict(defaults)
        self.optional = set(optional)

    def parse(self, body: bytes) -> tuple[dict[str, Any], float | None]:
        """The request's input overrides and its slo_ms; InputError names what is wrong."""
        try:
            request = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"the body is not valid JSON: {exc}") from None
        if not isinstance(request, dict):
            raise InputError('the body must be a JSON object: {"inputs": {...}}')
        extra = set(request) - {"inputs", "slo_ms"}
        if extra:
            raise InputError(f"unknown field {sorted(extra)[0]!r} in the body; it takes 'inputs' and 'slo_ms'")
        slo_ms = request.get("slo_ms")
        if slo_ms is not None and (isinstance(slo_ms, bool) or not isinstance(slo_ms, (int, float)) or slo_ms <= 0):
            raise InputError(f"slo_ms must be a positive number of milliseconds; got {slo_ms!r}")
        inputs = request.get("inputs")
        if not isinstance(inputs, dict):
            raise InputError('the body needs "inputs": an object with one entry per pipeline input')
        return self.check(inputs), slo_ms

    def check(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Type-check given inputs against the captured defaults and report the first missing one."""
        for name in inputs:
            if name not in self.defaults:
                raise unknown_input(name, self.defaults)
        missing = [n for n in self.defaults if n not in inputs and n not in self.optional]
        if missing:
            raise InputError(f"missing input {missing[0]!r}: every request gives {', '.join(sorted(self.defaults))}")
        return {name: _coerce(name, value, self.defaults[name]) for name, value in inputs.items()}

    def describe(self) -> dict[str, str]:
        return {name: _kind(default) for name, default in self.defaults.items()}


def _kind(default: Any) -> str:
    if default is None:
        return "any JSON value"
    if isinstance(default, (list, tuple)):
        return "a list"
    if isinstance(default, dict):
        return "an object"
    return _JSON_TYPES.get(type(default), f"fixed ({type(default).__name__} cannot travel as JSON)")


def _coerce(name: str, value: Any, default: Any) -> Any:
    expected = _kind(default)
    if default is None:
        return value
    if isinstance(default, bool) or isinstance(default, str):
        ok = type(value) is type(default)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        value = float(value) if ok else value
    elif isinstance(default, (list, tuple)):
        ok = isinstance(value, list)
        value = type(default)(value) if ok and isinstance(default, tuple) else value
    elif isinstance(default, dict):
        ok = isinstance(value, dict)
    else:
        raise InputError(f"input {name!r} is a {type(default).__name__}, which JSON cannot carry; it keeps its captured value")
    if not ok:
        raise InputError(f"input {name!r} must be {expected}, like its captured value; got {json.dumps(value)[:80]}")
    return value


def output_json(output: Any) -> bytes:
    """The pipeline's output as JSON; dataclasses, sets and numpy values are converted, anything else is an error."""
    return json.dumps(output, default=_convert, allow_nan=False).encode()


def _convert(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    raise TypeError(
        f"the pipeline's output holds a {type(value).__name__}, which JSON cannot carry; return str, numbers, lists or dicts"
    )
