"""The JSON edge of the front-end: request bodies checked against the pipeline's inputs, outputs to JSON.

An input's captured default fixes its JSON type: a str input takes a string, an int an integer,
a float any number, a tuple a list (turned back into a tuple), and so on. A value whose type JSON
cannot carry keeps its captured value and cannot be given by a request.

Whatever passes here can travel to a worker: the body is strict JSON (no NaN or Infinity, numbers
finite), nested at most `MAX_JSON_DEPTH` deep (checked before parsing, without recursion), and every
input pickles. So a bad body is the client's 400, never a failure blamed on a worker.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import re
from collections.abc import Mapping
from typing import Any

from patchkit.core.jsonable import NOT_JSON, json_form
from patchkit.core.options import OPTIONS, CallOptions, OptionError, integral
from patchkit.errors import InputError, unknown_input

__all__ = ["MAX_JSON_DEPTH", "MAX_SLO_MS", "InputSchema", "QueryBody", "coerce", "output_json", "steps_wanted"]

MAX_JSON_DEPTH = 64  # arrays and objects in a body nest at most this deep (the body's own object included)
MAX_SLO_MS = 3_600_000  # a request's slo_ms: at most an hour

_JSON_TYPES: dict[type, str] = {str: "a string", bool: "true or false", int: "an integer", float: "a number"}
_SCHEMA_TYPES: dict[type, str] = {str: "string", bool: "boolean", int: "integer", float: "number"}
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string literal (brackets inside it do not nest)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_OPENERS = frozenset(b"[{")


@dataclasses.dataclass(frozen=True)
class QueryBody:
    """A checked `POST /v1/query` body."""

    inputs: dict[str, Any]
    slo_ms: float | None = None
    stream: bool = False  # answer as server-sent events
    steps: bool = False  # with `stream`: a step event as each component call starts and ends
    options: CallOptions | None = None  # sampling options for the call that answers (core/options.py)
    field: str | None = None  # the field of a dict output the options (and the stream) are for


class InputSchema:
    """Checks `{"inputs": {...}, "slo_ms"?: n, "stream"?: bool, "steps"?: bool, "options"?: {...}, "field"?: str}`
    bodies; every input is required unless listed as optional."""

    def __init__(self, defaults: Mapping[str, Any], optional: tuple[str, ...] = ()) -> None:
        self.defaults = dict(defaults)
        self.optional = set(optional)

    def parse(self, body: bytes) -> QueryBody:
        """The request's input overrides, its slo_ms and whether it streams; InputError names what is wrong."""
        request = parse_json(body)
        if not isinstance(request, dict):
            raise InputError('the body must be a JSON object: {"inputs": {...}}')
        extra = set(request) - {"inputs", "slo_ms", "stream", "steps", "options", "field"}
        if extra:
            raise InputError(f"unknown field {sorted(extra)[0]!r} in the body; it takes 'inputs', 'slo_ms', 'stream', "
                             "'steps', 'options' and 'field'")
        slo_ms = _slo_ms(request.get("slo_ms"))
        stream, steps = request.get("stream", False), request.get("steps", False)
        for name, value in (("stream", stream), ("steps", steps)):
            if not isinstance(value, bool):
                raise InputError(f"{name} must be true or false; got {json.dumps(value)[:80]}")
        if steps and not stream:
            raise InputError('steps are events of a stream: send "stream": true with "steps": true')
        inputs = request.get("inputs")
        if not isinstance(inputs, dict):
            raise InputError('the body needs "inputs": an object with one entry per pipeline input')
        field = request.get("field")
        if field is not None and not isinstance(field, str):
            raise InputError(f"field must be the name of a field of the output; got {json.dumps(field)[:80]}")
        return QueryBody(self.check(inputs), slo_ms, stream, steps, _options(request.get("options")), field)

    def check(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Type-check given inputs against the captured defaults, report the first missing one, and
        check that each can travel to a worker."""
        for name in inputs:
            if name not in self.defaults:
                raise unknown_input(name, self.defaults)
        missing = [n for n in self.defaults if n not in inputs and n not in self.optional]
        if missing:
            raise InputError(f"missing input {missing[0]!r}: every request gives {', '.join(sorted(self.defaults))}")
        checked = {name: coerce(name, value, self.defaults[name]) for name, value in inputs.items()}
        _check_pickles(checked)
        return checked

    def describe(self) -> dict[str, str]:
        """Each input's JSON kind in words ("a string", "an integer", ...), as errors and `GET /v1/plan` name it."""
        return {name: _kind(default) for name, default in self.defaults.items()}

    def json_schema(self) -> dict[str, Any]:
        """The `inputs` object this schema accepts, as JSON Schema: what `/openapi.json`, the dashboard's form and
        the MCP tools publish for the pipeline.

        Every input is a property typed by its captured default and required unless optional (an optional one
        carries its default); an input JSON cannot carry is left out, since no request can give it.
        """
        properties: dict[str, Any] = {}
        for name, default in self.defaults.items():
            if (kind := _json_schema_of(default)) is not None:
                properties[name] = {**kind, **({"default": default} if name in self.optional and _jsonable(default)
                                               else {})}
        required = [name for name in properties if name not in self.optional]
        return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


def steps_wanted(body: QueryBody, query: str | None, offered: str) -> bool:
    """Whether a query asks for step events: its body's `steps`, or `?steps=true` (or 1; false, 0 or none: not).

    Asked for, they are checked: refused (InputError) where the deployment offers none (its server option `steps`,
    `offered`, is "off"), or without a stream."""
    if query is not None and query.lower() not in ("true", "1", "", "false", "0"):
        raise InputError(f"the query parameter steps must be true or false; got {query[:80]!r}")
    if not (body.steps or (query is not None and query.lower() in ("true", "1", ""))):
        return False
    if offered == "off":
        raise InputError('this deployment sends no step events (its server option steps is "off"): leave "steps" '
                         'out, or deploy with steps="timings" or steps="previews"')
    if not body.stream:
        raise InputError('steps are events of a stream: send "stream": true with "steps": true (or ?steps=true)')
    return True


def parse_json(body: bytes) -> Any:
    """Strict JSON: no NaN or Infinity, finite numbers, nested at most MAX_JSON_DEPTH deep."""
    if _depth_past(body, MAX_JSON_DEPTH):
        raise InputError(f"the body nests arrays and objects more than {MAX_JSON_DEPTH} deep; flatten the input")
    try:
        return json.loads(body, parse_constant=_no_constant, parse_float=_finite_float)
    except InputError:
        raise
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InputError(f"the body is not valid JSON: {exc}") from None


def _depth_past(body: bytes, limit: int) -> bool:
    """Whether the body's arrays and objects nest deeper than `limit`; a scan, not a parse, so that
    no depth can make it recurse. Malformed JSON passes: the parser reports it."""
    if body.count(b"[") + body.count(b"{") <= limit:  # nearly every body: too few brackets to nest that deep
        return False
    depth = 0
    for byte in _NOT_BRACKET.sub(b"", _STRING.sub(b"", body)):
        depth += 1 if byte in _OPENERS else -1
        if depth > limit:
            return True
        if depth < 0:  # a closer with nothing open: the parser stops there
            return False
    return False


def _no_constant(name: str) -> Any:
    raise InputError(f"the body holds {name}, which JSON does not have: send a finite number or null")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise InputError(f"the body holds {text[:40]}, which is too large for a number: send a finite number")
    return value


def _options(value: Any) -> CallOptions | None:
    """A body's `options`: an object of sampling options (`core.options.OPTIONS`), checked; None where absent."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InputError(f"options must be an object of sampling options; got {json.dumps(value)[:80]}")
    unknown = sorted(set(value) - set(OPTIONS))
    if unknown:
        raise InputError(f"unknown option {unknown[0]!r} in options; the options are {', '.join(OPTIONS)}")
    try:
        options = CallOptions.parse(value)
    except OptionError as exc:
        raise InputError(f"options: {exc}") from None
    return options if options.given() else None


def _slo_ms(value: Any) -> float | None:
    """A request's slo_ms: None, or a finite number of milliseconds in (0, MAX_SLO_MS]."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SLO_MS:
        huge = isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**20
        shown = f"an integer of {len(str(abs(value)))} digits" if huge else repr(value)
        raise InputError(f"slo_ms must be a positive number of milliseconds, at most {MAX_SLO_MS}; got {shown}")
    return float(value)


def _check_pickles(inputs: Mapping[str, Any]) -> None:
    """Every input can travel to a worker: a value that cannot be pickled is the request's error, not a worker's."""
    for name, value in inputs.items():
        if isinstance(value, (list, tuple, dict)):
            try:
                pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            except (RecursionError, pickle.PicklingError, TypeError, ValueError) as exc:
                raise InputError(f"input {name!r} cannot be sent to a worker ({type(exc).__name__}: {exc}); "
                                 "send a flatter value") from None


def _json_schema_of(default: Any) -> dict[str, Any] | None:
    """The JSON Schema of the values `coerce` accepts for an input with this captured default; None: none."""
    if default is None:
        return {}
    if isinstance(default, (list, tuple)):
        return {"type": "array"}
    if isinstance(default, dict):
        return {"type": "object"}
    kind = _SCHEMA_TYPES.get(type(default))
    return None if kind is None else {"type": kind}


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def _kind(default: Any) -> str:
    if default is None:
        return "any JSON value"
    if isinstance(default, (list, tuple)):
        return "a list"
    if isinstance(default, dict):
        return "an object"
    return _JSON_TYPES.get(type(default), f"fixed ({type(default).__name__} cannot travel as JSON)")


def coerce(name: str, value: Any, default: Any) -> Any:
    """`value` for input `name` as its captured `default` fixes its JSON type; InputError names a wrong one."""
    expected = _kind(default)
    if default is None:
        return value
    if isinstance(default, bool) or isinstance(default, str):
        ok = type(value) is type(default)
    elif isinstance(default, int):
        value = integral(value)  # 2.0 is the integer 2, as JSON Schema counts it
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
    converted = json_form(value)
    if converted is NOT_JSON:
        raise TypeError(f"the pipeline's output holds a {type(value).__name__}, which JSON cannot carry; return str, "
                        "numbers, lists or dicts")
    return converted
