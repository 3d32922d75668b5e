"""Which components are the same: one name per component across several pipelines, and a component's
fingerprint (its class, its code and its constructor arguments), which says whether a component of a new
version of a pipeline can keep the workers of one already deployed.

A component object several pipelines use is one component, deployed once (`deployed_names`). Two objects
with the same fingerprint build the same component in a worker: a component an update left as it was
(made again by a script run again) is the one deployed, and keeps its workers, their queues and caches.
"""

from __future__ import annotations

import hashlib
import io
import marshal
import types
from collections.abc import Container, Mapping
from typing import TYPE_CHECKING, Any

import cloudpickle

if TYPE_CHECKING:
    from patchkit.core.base import Component

__all__ = ["code_digest", "deployed_name", "deployed_names", "fingerprint"]


def deployed_names(pipelines: Mapping[str, Mapping[str, Component]]) -> dict[str, Component]:
    """The components of several pipelines (by pipeline name, each its components by name), one entry per
    component object, under the first pipeline's name for it; a name another object took already is
    `pipeline/name` (`deployed_name`)."""
    named: dict[str, Component] = {}
    seen: set[str] = set()
    for pipeline, components in pipelines.items():
        for name, component in components.items():
            if (uid := component._patchkit_spec.uid) not in seen:
                seen.add(uid)
                named[deployed_name(name, pipeline, 1, named)] = component
    return named


def deployed_name(name: str, pipeline: str, version: int, taken: Container[str]) -> str:
    """The name a pipeline's component `name` is deployed under: its own, else (another component has it) for a
    later version of the pipeline `name@v<version>`, else `pipeline/name`, else `pipeline/name@v<version>`."""
    later = version > 1
    candidates = [name, f"{name}@v{version}" if later else None, f"{pipeline}/{name}", f"{pipeline}/{name}@v{version}"]
    return next(c for c in candidates if c is not None and c not in taken)


def fingerprint(component: Component) -> str:
    """A digest of what a worker builds the component from: its class (module, name, the code of its methods
    and of its bases' but `Component`'s) and its constructor arguments, a held component by its own fingerprint.

    Line numbers and file names are left out: an edit elsewhere in the file changes no fingerprint."""
    spec = component._patchkit_spec
    digest = hashlib.sha256()
    for cls in spec.cls.__mro__:
        if cls.__module__.startswith("patchkit.core.") or cls is object:  # Component (patchkit.core.base), not the built-ins
            continue
        digest.update(f"{cls.__module__}.{cls.__qualname__}".encode())
        for name, value in sorted(vars(cls).items()):
            code = _code_of(value)
            digest.update(name.encode() + (code_digest(code) if code is not None else b""))
    digest.update(_arguments(spec.args, spec.kwargs))
    return digest.hexdigest()[:16]


def _code_of(value: Any) -> types.CodeType | None:
    """The code of a method, static or class method, or property getter defined in a class body."""
    for inner in (value, getattr(value, "__func__", None), getattr(value, "fget", None), getattr(value, "__wrapped__", None)):
        code = getattr(inner, "__code__", None)
        if isinstance(code, types.CodeType):
            return code
    return None


def code_digest(code: types.CodeType) -> bytes:
    """What a code object computes: its bytecode, names and constants, nested code objects the same way."""
    consts = tuple(_constant(c) for c in code.co_consts)
    parts = (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars, repr(consts))
    return hashlib.sha256(marshal.dumps(tuple(p if not isinstance(p, str) else p.encode() for p in parts))).digest()


def _constant(value: Any) -> Any:
    """A constant as the digest reads it: code by its digest, plain data as it is, anything else (a function a
    rewritten program holds) by its qualified name, never its address."""
    if isinstance(value, types.CodeType):
        return code_digest(value)
    if isinstance(value, (tuple, frozenset)):
        return tuple(_constant(v) for v in value)
    if value is None or isinstance(value, (str, bytes, int, float, complex, type(Ellipsis))):
        return value
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"


def _arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    _ArgumentPickler(buffer).dump((args, sorted(kwargs.items())))
    return buffer.getvalue()


class _ArgumentPickler(cloudpickle.Pickler):
    """Pickles arguments with each component they hold as its fingerprint (its uid differs in every process)."""

    def persistent_id(self, obj: Any) -> str | None:
        from patchkit.core.base import Component

        return fingerprint(obj) if isinstance(obj, Component) else None
