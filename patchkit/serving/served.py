"""Which deployed component serves each component a pipeline calls: the deployment's names, fingerprints and aliases.

A component object several pipelines use is deployed once (`patchkit.program.identity.deployed_names`); a
component of a new version whose version (the digest of its identity, `patchkit.program.identity`, computed where
the user's code is and carried by its spec) is a deployed one's is served by that one, its workers, queues and
caches kept; so is a copy a loading process's modules hold (`Pipeline.component_aliases`). `Deployment`
(deployment.py) is made of this, and writes these maps as it registers, adopts and forgets components; nothing
here derives a digest.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from patchkit.core import Component
from patchkit.program.identity import deployed_name, stamped_digest

if TYPE_CHECKING:
    from patchkit.program.pipeline import Pipeline  # the top layer: a type only

__all__ = ["ServedComponents", "pipeline_uids"]

logger = logging.getLogger(__name__)


class ServedComponents:
    """The deployed components by name, and how each component a pipeline calls reaches one (on the front-end's loop)."""

    def __init__(self) -> None:
        self.components: dict[str, Component] = {}  # deployed name -> the component its workers run
        self.names: dict[str, str] = {}  # uid -> deployed name
        self.fingerprints: dict[str, str] = {}  # version (`ComponentSpec.digest`) -> deployed name
        self.aliases: dict[str, Component] = {}  # uid of a component a deployed one serves -> that one

    def new_components(self, pipelines: Mapping[str, Pipeline], versions: Mapping[str, int]) -> dict[str, Component]:
        """The components of `pipelines` (by name, each at the version number `versions` gives) that no deployed
        one serves (the same object, or one of its fingerprint), each object once, by the names `add` deploys
        them as (`deployed_name`: for a first deployment, `deployed_names`' names). One component is one uid: a
        component several pipelines share arrives as a copy per pipeline when they travel pickled."""
        new: dict[str, Component] = {}
        for pipeline_name, pipeline in pipelines.items():
            for name, component in pipeline.components.items():
                uid = component._patchkit_spec.uid  # one component however many copies its pipelines' pickles made
                if uid in self.names:
                    _warn_if_edited(self.names[uid], component, self.fingerprints)
                if self._serving(component) is None and all(c._patchkit_spec.uid != uid for c in new.values()):
                    new[deployed_name(name, pipeline_name, versions[pipeline_name], {*self.components, *new})] = component
        return new

    def replaced(self, pipelines: Mapping[str, Pipeline], new: Mapping[str, Component],
                 served: Mapping[str, Pipeline]) -> dict[str, str]:
        """Of `new` (by deployed name, as `new_components` gave them), each that is a new version of a deployed
        component, with that one's name: the component the same pipeline names alike in its version `served` now.
        A name new to its pipeline replaces nothing."""
        by_uid = {component._patchkit_spec.uid: name for name, component in new.items()}
        found: dict[str, str] = {}
        for pipeline_name, pipeline in pipelines.items():
            current = served.get(pipeline_name)
            for var, component in pipeline.components.items():
                name = by_uid.get(component._patchkit_spec.uid)
                previous = None if current is None else current.components.get(var)
                if name is None or name in found or previous is None:
                    continue
                found[name] = self.names[self.deployed(previous)._patchkit_spec.uid]
        return found

    def _serving(self, component: Component) -> Component | None:
        """The deployed component that serves `component`'s calls: itself, its alias, or one of its fingerprint."""
        uid = component._patchkit_spec.uid
        if uid in self.names:
            return self.components[self.names[uid]]
        if uid in self.aliases:
            return self.aliases[uid]
        name = self.fingerprints.get(stamped_digest(component))
        return None if name is None else self.components[name]

    def deployed(self, component: Component) -> Component:
        """The deployed component a call of `component` goes to: itself, or the one that serves it (`add`)."""
        return self.aliases.get(component._patchkit_spec.uid, component)

    def holds(self, pipeline: Pipeline) -> set[str]:
        """The deployed names of the components that serve `pipeline`'s calls."""
        return {self.names[self.deployed(c)._patchkit_spec.uid] for c in pipeline.components.values()}


def _warn_if_edited(name: str, component: Component, fingerprints: Mapping[str, str]) -> None:
    """Say so where a deployed component object comes back with an edit of what it reads (its class changed in
    place, a global of its module assigned again): one object is one component, whose workers it keeps."""
    if name in fingerprints.values() and fingerprints.get(stamped_digest(component)) != name:
        logger.warning("%s is the object deployed, but what its code reads changed since: it keeps its workers, "
                       "which start no new version of it; make the object again to deploy the edit", name)


def pipeline_uids(pipeline: Pipeline) -> set[str]:
    """The uids of a pipeline's component objects, the copies its helpers' modules hold included."""
    return {c._patchkit_spec.uid for c in pipeline.components.values()} | set(pipeline.component_aliases())
