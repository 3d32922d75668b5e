"""deploy()'s options as typed groups, and the config the front-end runs.

    options.py     what one option is: `option()`, the metadata on its field, and the checks it drives
    groups.py      the groups: server, limits, liveness, slo, autoscaling, ray, chat
    deployment.py  DeploymentConfig (the components' sizes, the backend, a field per group), `resolve`, `describe`
    backends.py    `make_backend`: the backend a config names, built from its options (imported by the front-end
                   process only, never from here)

`OPTIONS` maps every option's flat name (the one deploy(), `patchkit serve` and its config file take) to
where it lives: `OPTIONS["ray_address"].path == "ray.address"`.
"""

from patchkit.config.deployment import OPTIONS, ComponentConfig, DeploymentConfig
from patchkit.config.groups import (
    BACKENDS,
    ESTIMATORS,
    LOG_LEVELS,
    AutoscalingConfig,
    ChatConfig,
    LimitsConfig,
    LivenessConfig,
    RayConfig,
    ServerConfig,
    SloConfig,
)
from patchkit.config.options import OptionSpec

__all__ = [
    "BACKENDS",
    "ESTIMATORS",
    "LOG_LEVELS",
    "OPTIONS",
    "AutoscalingConfig",
    "ChatConfig",
    "ComponentConfig",
    "DeploymentConfig",
    "LimitsConfig",
    "LivenessConfig",
    "OptionSpec",
    "RayConfig",
    "ServerConfig",
    "SloConfig",
]
