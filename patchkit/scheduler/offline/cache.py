"""The profiler's on-disk cache: a method's profile, keyed by what it was measured on.

The key is the component's version (its identity's digest, `patchkit.program.identity`: its class's
code, the globals and helpers it reads, its constructor arguments, the files it reads, its declared
version), the method, the resource type, the thread count, the recorded calls, and how sizes were
measured: a method edited to do more is profiled again. It must be the same in another process and
for another object built alike, so it never reads a component's uid (new in every process): a
component among the arguments or the calls stands for its version, at any depth, and sets are taken
in a sorted order (their iteration order changes with the process's string hashing).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import cloudpickle

from patchkit import envs
from patchkit.core import Component
from patchkit.program.identity import component_digest
from patchkit.scheduler.offline.profiles import MethodProfile

__all__ = ["ProfileCache", "identity"]

MAX_DEPTH = 32  # nesting of arguments the key follows; deeper values are taken as they pickle


def identity(value: Any, depth: int = 0) -> Any:
    """`value` as the cache key sees it: components by their version, sets sorted, recursively."""
    if depth > MAX_DEPTH:
        return value
    if isinstance(value, Component):
        return "component", component_digest(value)
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(identity(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return "dict", tuple((identity(k, depth + 1), identity(v, depth + 1)) for k, v in value.items())
    if isinstance(value, (set, frozenset)):
        return "set", tuple(sorted((identity(v, depth + 1) for v in value), key=repr))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple((f.name, identity(getattr(value, f.name), depth + 1)) for f in dataclasses.fields(value))
        return type(value).__module__, type(value).__qualname__, fields
    return value


def digest(value: Any) -> str:
    """A short hex digest of `identity(value)`: equal for values alike in every process.

    Not the pickle of it: pickle writes an object met twice as a reference to the first, so two equal
    values pickle differently when one shares a string where the other holds two copies (as a value
    that crossed a process boundary does)."""
    hasher = hashlib.sha256()
    _feed(hasher, identity(value))
    return hasher.hexdigest()[:24]


def _feed(hasher: Any, value: Any) -> None:
    if isinstance(value, tuple):
        hasher.update(b"(%d" % len(value))
        for item in value:
            _feed(hasher, item)
        hasher.update(b")")
    elif value is None or isinstance(value, (bool, int, float, str, bytes)):
        text = repr(value).encode()
        hasher.update(b"%s:%d:%s" % (type(value).__name__.encode(), len(text), text))
    else:  # anything else as it pickles (an array, a function): alike values pickle alike
        data = cloudpickle.dumps(value)
        hasher.update(b"pickle:%d:%s" % (len(data), data))


class ProfileCache:
    """Method profiles under `PATCHKIT_CACHE_DIR/profiles`, one JSON file each."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root if root is not None else envs.cache_dir() / "profiles"

    def path(self, key: Any) -> Path:
        return self.root / f"{digest(key)}.json"

    def load(self, key: Any, method: str) -> MethodProfile | None:
        """The profile stored under `key`, or None (never stored, or unreadable: then measured again)."""
        try:
            return MethodProfile.from_dict(method, json.loads(self.path(key).read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def store(self, key: Any, profile: MethodProfile) -> None:
        """Write atomically: a reader sees the old file or the whole new one."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(profile.to_dict()))
        tmp.replace(path)
