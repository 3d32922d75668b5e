"""The one place a deployment's transport is chosen: the backend its config names, built from its options.

Called by the front-end process when it builds a deployment; the online scheduler and serving never name a
concrete backend. It sits with the options it reads (`DeploymentConfig`), above the orchestrator whose backends it
builds, so the orchestrator never sees a deployment's configuration. Each backend places its own replicas
(`Backend.place`).
"""

from __future__ import annotations

from patchkit.config.deployment import DeploymentConfig
from patchkit.orchestrator.backend import Backend
from patchkit.orchestrator.inprocess import InProcessBackend
from patchkit.orchestrator.local import LocalBackend

__all__ = ["make_backend"]


def make_backend(config: DeploymentConfig) -> Backend:
    """The backend `config.backend` names: `local` worker processes on 127.0.0.1, `inprocess` objects, or `ray` actors."""
    if config.backend == "inprocess":
        return InProcessBackend()
    if config.backend == "ray":
        from patchkit.orchestrator.ray_backend import RayBackend  # imports nothing of Ray until it connects

        return RayBackend(config.secret, config.ray_options(), gpu_units=_gpu_units(config))
    return LocalBackend(config.secret, host="127.0.0.1")


def _gpu_units(config: DeploymentConfig) -> int:
    """GPU units the plan gives all replicas together; the Ray backend shares GPUs when the cluster has fewer."""
    if config.plan is None:
        return 0
    return sum(c.replicas * c.units for c in config.components.values() if c.resource == "gpu")
