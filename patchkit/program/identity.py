"""Which components are the same: one name per component across several pipelines, and a component's
identity (everything its behaviour depends on), which says whether a component of a new version of a
pipeline can keep the workers of one already deployed.

A component object several pipelines use is one component, deployed once (`deployed_names`). Two objects
of one identity build the same component in a worker: a component an update left as it was (made again by
a script run again) is the one deployed, and keeps its workers, their queues and caches.

An identity is a map of parts, each what one thing the component's code reads digests to: each attribute
of its class and of its bases (methods by their code, their default arguments apart, constants by their
values), each module global and helper its code reads (followed through the helpers' own code, closures
and nested functions included, and through the user's own modules' attributes, as `prompts.fmt`), its
constructor arguments, the files it reads (`Component.version_files`, `files.py`) and the version it
declares (`Component.version`); the walk that reads them, and how values digest (by content, never by
`repr`), is `walk.py`. The parts that differ between two identities say what changed (`Identity.changes`).
Line numbers, file names and memory addresses are never read: a blank line or a comment changes nothing.

A version is computed where the user's code is, once per deploy, update, reload or plan (`stamp`), and
travels with the pipeline and its components (`ComponentSpec.digest`); the front-end compares those digests
and never derives one.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Any

from patchkit.core import Component
from patchkit.errors import PatchkitError
from patchkit.program.origin import users_module
from patchkit.program.walk import Memo, Walk, code_digest, parts_digest

__all__ = ["Identity", "Memo", "PipelineVersion", "code_digest", "component_digest", "deployed_name", "deployed_names",
           "fingerprint", "identity", "program_identity", "stamp_component", "stamped_digest", "users_module"]

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


@dataclass(frozen=True)
class Identity:
    """What a component (or a pipeline's own code) is: a digest per part, by what the part is, as
    `Gen.PROMPT`, `Gen.generate`, `Gen.generate default arguments`, `module constant TEMPLATE`, `helper fmt`,
    `constructor arguments`."""

    parts: Mapping[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        """One digest of every part: equal for identities of equal parts, in any process."""
        return parts_digest(self.parts)

    def changes(self, before: Identity) -> list[str]:
        """The parts that differ from `before`'s (changed, added or gone), sorted; empty for the same identity."""
        labels = set(self.parts) | set(before.parts)
        return sorted(label for label in labels if self.parts.get(label) != before.parts.get(label))


@dataclass(frozen=True)
class PipelineVersion:
    """A pipeline's version: its own identity (its code, the globals it reads, its inputs and output) and each
    component's, by name; made by `Pipeline.stamp` where the user's code is, and travelling with the pipeline."""

    own: Identity
    components: Mapping[str, Identity]

    @property
    def whole(self) -> Identity:
        """One identity of it all: the pipeline's own parts, and a part `component NAME` per component."""
        return Identity({**self.own.parts, **{f"component {n}": c.digest for n, c in self.components.items()}})

    @property
    def digest(self) -> str:
        """What `X-Pipeline-Version` names: equal for the same code, inputs and components."""
        return self.whole.digest

    def changes(self, before: PipelineVersion) -> list[str]:
        """What differs from `before`, one entry per pipeline or component, naming the parts changed:
        `gen changed: Gen.PROMPT, module constant TEMPLATE`, `the pipeline changed: pipeline code`, `rank is new`."""
        found = []
        if own := self.own.changes(before.own):
            found.append(f"the pipeline changed: {', '.join(own)}")
        for name, component in self.components.items():
            old = before.components.get(name)
            if old is None:
                found.append(f"{name} is new")
            elif parts := component.changes(old):
                found.append(f"{name} changed: {', '.join(parts)}")
        found += [f"{name} is gone" for name in before.components if name not in self.components]
        return found


def identity(component: Component, memo: Memo | None = None) -> Identity:
    """Everything `component`'s behaviour depends on, part by part; see the module's docstring."""
    walk = Walk(component._patchkit_spec.cls.__module__, memo)
    walk.component(component)
    return Identity(walk.parts)


def fingerprint(component: Component) -> str:
    """The digest of `component`'s identity, computed now: equal for two components a worker builds alike."""
    return identity(component).digest


def stamp_component(component: Component, digest: str) -> None:
    """Make `digest` (its identity's, computed here) the version `component` travels with (`ComponentSpec.digest`)."""
    spec = component._patchkit_spec
    if spec.digest != digest:
        component.__dict__["_patchkit_spec"] = dataclasses.replace(spec, digest=digest)


def stamped_digest(component: Component) -> str:
    """The version `component` travels with; for a process that holds no user code, which never derives one.

    Raises:
        PatchkitError: it was never stamped (`Pipeline.stamp` runs where the user's code is).
    """
    digest = component._patchkit_spec.digest
    if not digest:
        raise PatchkitError(f"{component!r} carries no version: stamp its pipeline (Pipeline.stamp) where its code is")
    return digest


def component_digest(component: Component) -> str:
    """The version `component` travels with, else its fingerprint computed now (and kept as its version)."""
    digest = component._patchkit_spec.digest
    if not digest:
        digest = fingerprint(component)
        stamp_component(component, digest)
    return digest


def program_identity(code: types.CodeType, module_globals: Mapping[str, Any] | None, module_name: str,
                     values: Mapping[str, Any], inputs: Mapping[str, Any] | None = None,
                     memo: Memo | None = None) -> Identity:
    """A captured body's identity: its `code`, the globals of `module_globals` (its module's, or None) it
    reads, followed as a component's are, `values` (the objects it is bound to) and `inputs` (its inputs'
    defaults), each by name and by value. Components among them count by their fingerprint."""
    walk = Walk(module_name, memo)
    walk.parts["pipeline code"] = code_digest(code).hex()
    if module_globals is not None:
        walk.globals_read(code, module_globals, module_name)
    for name, value in sorted(values.items()):
        walk.parts[f"bound {name}"] = walk.value(value).hex()
    for name, value in sorted((inputs or {}).items()):
        walk.parts[f"input {name}"] = walk.value(value).hex()
    return Identity(walk.parts)


