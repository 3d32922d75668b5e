"""What a request may ask of the call that answers it, and what that call reports back.

A request names sampling options (an OpenAI chat request's `max_tokens`, `stop`, `seed`, ...): they
travel as one `CallOptions` to the call whose text is the reply, the call a stream follows, as the
`options` argument of a `@make` method that declares one (every built-in generator's `generate`).
Which of them a component honours it says with `honoured_options`; a request asking for one the
answering call does not honour is refused before anything runs. Every other call keeps its own settings.

That call reports back with a `CallReport` (the tokens its tokenizer counted, why it ended, the
logprobs): a streaming method yields it after its last text chunk, and its callers get an `Answer`,
the joined text as a `str` that carries the report.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "OPTIONS", "OPTIONS_ARGUMENT", "Answer", "CallOptions", "CallReport", "Chunk", "OptionError", "honoured_options",
    "integral", "joined", "option_schema", "options_schema",
]

OPTIONS_ARGUMENT = "options"  # the parameter a `@make` method declares to take a request's CallOptions
MAX_STOPS = 4  # OpenAI's limit on `stop` strings
MAX_TOP_LOGPROBS = 20
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class OptionError(ValueError):
    """A call option that is out of range or of the wrong type; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class CallOptions:
    """A request's sampling options for the call that answers it, each None (or empty) where not given.

    The names and meanings are OpenAI's chat completion parameters; `ignore_eos` and `min_tokens` are
    vLLM's extensions that load generators send. `response_format` is OpenAI's object:
    `{"type": "json_object"}`, or `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`.
    """

    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None

    @classmethod
    def parse(cls, values: Mapping[str, Any]) -> CallOptions:
        """Options from a request's JSON fields of these names (None counts as absent), checked.

        Raises:
            OptionError: a value of the wrong type or out of range, naming its field.
        """
        given = {name: value for name, value in values.items() if value is not None and name in OPTIONS}
        checked = {name: _CHECKS[name](name, value) for name, value in given.items()}
        if "top_logprobs" in checked and not checked.get("logprobs"):
            raise OptionError("top_logprobs", "top_logprobs needs logprobs: true")
        if checked.get("response_format") == {"type": "text"}:
            del checked["response_format"]  # OpenAI's default: nothing asked
        return cls(**checked)

    def given(self) -> tuple[str, ...]:
        """The names of the options that are set, in declaration order."""
        return tuple(f.name for f in fields(self) if getattr(self, f.name) != f.default)

    def json_schema(self) -> dict[str, Any] | None:
        """The JSON schema the answer must match: `{}` for any JSON object (json_object), None for free text."""
        if self.response_format is None:
            return None
        if self.response_format["type"] == "json_object":
            return {"type": "object"}
        schema: dict[str, Any] = self.response_format["json_schema"].get("schema") or {"type": "object"}
        return schema


@dataclass(frozen=True)
class CallReport:
    """What the call that answered reports: tokens counted by its own tokenizer, and how it ended.

    `prompt_tokens`: the prompt it evaluated (its chat template included), `completion_tokens`: the tokens it
    made; `finish_reason`: "stop" (the model ended, or a stop string), "length" (max_tokens); `logprobs`:
    OpenAI's `choices[].logprobs.content` entries where asked and the engine has them; `counted`: False where
    the numbers are estimates (no tokenizer), which a reply then says.
    """

    prompt_tokens: int
    completion_tokens: int
    finish_reason: str = "stop"
    logprobs: list[dict[str, Any]] | None = None
    counted: bool = True


Chunk = str | CallReport  # what a streaming method yields: text, then at most one report, last


class Answer(str):
    """A call's text with its `CallReport`: equal to, and used as, the plain string."""

    report: CallReport

    def __new__(cls, text: str, report: CallReport) -> Answer:
        answer = super().__new__(cls, text)
        answer.report = report
        return answer

    def __reduce__(self) -> tuple[Any, ...]:
        return Answer, (str(self), self.report)


def joined(chunks: Iterable[Chunk]) -> str:
    """A streaming call's result: its text chunks joined, an `Answer` where it reported last."""
    parts: list[str] = []
    report: CallReport | None = None
    for chunk in chunks:
        if isinstance(chunk, CallReport):
            report = chunk
        else:
            parts.append(chunk)
    text = "".join(parts)
    return text if report is None else Answer(text, report)


def honoured_options(component: object) -> frozenset[str]:
    """The call options `component` honours (its `honoured_options` attribute; none for any other component)."""
    names: object = getattr(component, "honoured_options", frozenset())
    return frozenset(names) if isinstance(names, (frozenset, set, tuple, list)) else frozenset()


def integral(value: Any) -> Any:
    """An integer as JSON Schema counts one: an int, or a float with no fraction (`1.0`, which a JSON parser reads as a
    float), as that int; anything else as it is (never a bool)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(low: int, high: int | None = None) -> Any:
    def check(name: str, value: Any) -> int:
        value = integral(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
            within = f">= {low}" if high is None else f"from {low} to {high}"
            raise OptionError(name, f"{name} must be an integer {within}; got {value!r}")
        return value
    return check


def _number(low: float, high: float, *, open_low: bool = False) -> Any:
    def check(name: str, value: Any) -> float:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
        if not ok or value > high or value < low or (open_low and value == low):
            bounds = f"{'>' if open_low else '>='} {low:g} and <= {high:g}"
            raise OptionError(name, f"{name} must be a number {bounds}; got {value!r}")
        return float(value)
    return check


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise OptionError(name, f"{name} must be true or false; got {value!r}")
    return value


def _stop(name: str, value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise OptionError(name, f"stop must be a non-empty string or a list of at most {MAX_STOPS}; got {value!r}")
    return tuple(stops)


def _seed(name: str, value: Any) -> int:
    value = integral(value)
    if isinstance(value, bool) or not isinstance(value, int) or not -(2**63) <= value < 2**64:
        raise OptionError(name, f"seed must be an integer; got {value!r}")
    return value


def _response_format(name: str, value: Any) -> dict[str, Any]:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in RESPONSE_FORMATS:
        raise OptionError(name, f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMATS)}; "
                          f"got {value!r:.200}")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise OptionError(name, 'response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}')
    return dict(value)


_CHECKS: dict[str, Any] = {
    "max_tokens": _int(1), "stop": _stop, "temperature": _number(0, 2), "top_p": _number(0, 1, open_low=True),
    "seed": _seed, "presence_penalty": _number(-2, 2), "frequency_penalty": _number(-2, 2),
    "response_format": _response_format, "logprobs": _bool, "top_logprobs": _int(0, MAX_TOP_LOGPROBS), "ignore_eos": _bool,
    "min_tokens": _int(0),
}
OPTIONS: tuple[str, ...] = tuple(f.name for f in fields(CallOptions))  # every option a request may name


def _range(kind: str, low: float | None = None, high: float | None = None, *, open_low: bool = False) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": kind}
    if low is not None:
        schema["exclusiveMinimum" if open_low else "minimum"] = low
    if high is not None:
        schema["maximum"] = high
    return schema


_RESPONSE_FORMAT: dict[str, Any] = {
    "type": "object", "required": ["type"], "properties": {"type": {"enum": list(RESPONSE_FORMATS)}},
    "if": {"properties": {"type": {"const": "json_schema"}}},
    "then": {"required": ["json_schema"], "properties": {"json_schema": {
        "type": "object", "properties": {"schema": {"type": "object"}}}}},
}
# Each option's values as JSON Schema: what its check in `_CHECKS` accepts, kept beside it.
_SCHEMAS: dict[str, dict[str, Any]] = {
    "max_tokens": _range("integer", 1), "stop": {"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOPS}]},
    "temperature": _range("number", 0, 2), "top_p": _range("number", 0, 1, open_low=True),
    "seed": _range("integer", -(2**63), 2**64 - 1), "presence_penalty": _range("number", -2, 2),
    "frequency_penalty": _range("number", -2, 2), "response_format": _RESPONSE_FORMAT, "logprobs": {"type": "boolean"},
    "top_logprobs": _range("integer", 0, MAX_TOP_LOGPROBS), "ignore_eos": {"type": "boolean"},
    "min_tokens": _range("integer", 0),
}
# What an option no call honours may still be sent as: its default (it asks for nothing), or null.
_UNASKED: dict[str, list[Any]] = {"stop": [[]], "response_format": [{"type": "text"}], "logprobs": [False],
                                  "ignore_eos": [False]}


def option_schema(name: str, honoured: bool = True) -> dict[str, Any]:
    """The JSON Schema of the values a request may give option `name` (null counts as absent): any value its check
    accepts where the call that answers honours it, else only what asks for nothing (its default, or null).

    Published for the query and chat routes' bodies (`GET /openapi.json`)."""
    if not honoured:
        return {"enum": [None, *_UNASKED.get(name, [])], "description": "not honoured by the call that answers"}
    return {"anyOf": [_SCHEMAS[name], {"type": "null"}]}


# top_logprobs needs logprobs: true (`CallOptions.parse`), as a schema of the object that holds both.
NEEDS_LOGPROBS: dict[str, Any] = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}


def options_schema(honoured: Iterable[str] | None = None) -> dict[str, Any]:
    """The JSON Schema of a query's `options` object (or null): each option by `option_schema`, those in `honoured`
    (None: every option) with any value its check accepts."""
    allowed = set(OPTIONS if honoured is None else honoured)
    properties = {name: option_schema(name, name in allowed) for name in OPTIONS}
    return {"anyOf": [{"type": "object", "properties": properties, "additionalProperties": False, **NEEDS_LOGPROBS},
                      {"type": "null"}]}
