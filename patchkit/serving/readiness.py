"""What the probes answer: a pipeline's readiness, and the front-end's, made of its pipelines' and components'.

`Readiness` is the body of `/v1/pipelines/{name}/readyz` (`of_pipeline`) and of `/readyz` (`of_pipelines`),
made by the front-end (frontend.py) from each component's state, as `StatsCollector.not_ready` reads it: "failed"
(see `Deployment.fail`), "unready" (no replica of it serves) or "degraded" (one serves, another is replaced or
fails its checks), those ready left out. The probes ask no token: their lines name replicas and states, never
an error's text.

A pipeline is "failed" while a component it calls is, "unready" while one has no replica serving, else
"ready": a degraded component still serves its calls. The front-end is ready (HTTP 200) while every pipeline
that is not failed is ready: "ready", or "degraded" where some are failed. A failed pipeline stays so until an
update gives its component another try (nothing restarts it in a loop), and its requests are answered at once
with 503 naming it, so it holds no other pipeline out of a load balancer's rotation. The front-end is 503 while
a pipeline that is not failed is not ready ("unready": a replica is restarting, which ends served or failed),
where every pipeline is failed ("failed"), and while it starts or drains.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from patchkit.errors import ComponentFailed

__all__ = ["DRAINING", "STARTING", "ComponentStates", "Readiness", "of_pipeline", "of_pipelines", "report_start"]

logger = logging.getLogger(__name__)

# By component name, the state of each one not wholly ready and why: "failed", "unready" or "degraded".
ComponentStates = Mapping[str, tuple[str, list[str]]]


@dataclass(frozen=True)
class Readiness:
    """`status` ("ready", "degraded", "starting", "unready", "failed" or "draining") and why it is not ready; the
    front-end's also carries each pipeline's (`pipelines`) and that of each component not wholly ready
    (`components`: "failed", "unready" or "degraded")."""

    status: str
    reasons: tuple[str, ...] = ()
    pipelines: Mapping[str, Readiness] = field(default_factory=dict)
    components: Mapping[str, Readiness] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        """Whether it takes requests (HTTP 200): "ready", or "degraded" (the pipelines not failed are all ready)."""
        return self.status in ("ready", "degraded")

    def to_json(self) -> dict[str, Any]:
        """The probe's body: `status` and `reasons`; the front-end's adds `pipelines` and `components`, each one's
        `status` and `reasons`."""
        body: dict[str, Any] = {"status": self.status, "reasons": list(self.reasons)}
        if self.pipelines:
            body["pipelines"] = {name: own.to_json() for name, own in self.pipelines.items()}
            body["components"] = {name: own.to_json() for name, own in self.components.items()}
        return body


STARTING = Readiness("starting", ("the workers are starting",))
DRAINING = Readiness("draining", ("the endpoint is shutting down",))


def of_pipeline(held: Iterable[str], states: ComponentStates) -> Readiness:
    """The readiness of a pipeline whose calls the components `held` serve: "failed" where one of them is failed,
    else "unready" where one has no replica serving, else "ready"."""
    found = [states[name] for name in sorted(held) if name in states]
    reasons = tuple(line for state, lines in found if state != "degraded" for line in lines)
    if any(state == "failed" for state, _ in found):
        return Readiness("failed", reasons)
    return Readiness("unready" if reasons else "ready", reasons)


def of_pipelines(pipelines: Mapping[str, Readiness], held: Iterable[str], states: ComponentStates) -> Readiness:
    """The front-end's readiness, of its `pipelines`' own (by name) and the states of the components `held` that
    serve them (see the module's docstring)."""
    serving = [own for own in pipelines.values() if own.status != "failed"]
    if not serving:
        status = "failed"
    elif not all(own.ready for own in serving):
        status = "unready"
    else:
        status = "degraded" if len(serving) < len(pipelines) else "ready"
    reasons = tuple(dict.fromkeys(line for own in pipelines.values() for line in own.reasons))
    components = {name: Readiness(states[name][0], tuple(states[name][1])) for name in sorted(held) if name in states}
    return Readiness(status, reasons, pipelines, components)


def report_start(failed: Mapping[str, Mapping[str, str]], errors: Mapping[str, Exception], *, fail_fast: bool) -> None:
    """Called by the front-end once its first start ends, with each pipeline's failed components and why
    (`failed`: every pipeline, by name; empty for one that serves) and the components' start errors: says which
    pipelines are failed (a WARNING line each, naming the component and why); raises the first failed component's
    start error where none serves, or where `fail_fast` is set."""
    serving = [name for name, components in failed.items() if not components]
    if len(serving) == len(failed):
        return
    then = ("fail_fast is set: the deployment stops" if fail_fast else
            f"the others serve ({', '.join(serving)})" if serving else "no pipeline can serve: the deployment stops")
    for name, components in failed.items():
        for component, why in components.items():  # why: a start error, else what failed it since (a crash)
            error = errors.get(component)
            said = why if error is None else f"its component {component} could not start: {type(error).__name__}: {error}"
            logger.warning("pipeline %s is failed: %s; %s", name, said, then)
    if fail_fast or not serving:
        first, why = next(item for components in failed.values() for item in components.items())
        raise errors.get(first) or ComponentFailed(why)
