"""Values as JSON carries them: the conversions a reply's output and a step's preview share.

A dataclass instance becomes the object of its fields, a set a list (sorted by repr, so that a reply does not
change between runs), and a numpy array or scalar (anything with `tolist`) its list or number. The front-end's
replies (`server/inputs.py`'s `output_json`) refuse whatever else JSON cannot carry; a step's preview
(`serving/steps.py`) shows it as a short type name instead.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["NOT_JSON", "json_form"]

NOT_JSON = object()  # what `json_form` returns for a value it knows no JSON form of


def json_form(value: Any) -> Any:
    """One step of conversion: `value` itself where JSON carries its type (str, numbers, bool, None, list, tuple,
    dict), else its converted form (its items or fields not converted yet), else `NOT_JSON`."""
    if value is None or isinstance(value, (str, int, float, list, tuple, dict)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    return NOT_JSON
