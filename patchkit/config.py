"""How a deployment is configured: per component, its replicas and per-method batch sizes.

`DeploymentConfig.resolve` turns deploy()'s arguments into a config: replicas and batch sizes come
from a `Plan` when one is given, else from the arguments or the components' own defaults
(`@make(max_batch_size=...)`).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from patchkit import envs
from patchkit.component import make_methods
from patchkit.errors import ConfigError, InputError
from patchkit.orchestrator.ray_options import RayOptions
from patchkit.scheduler.offline.plan import Plan

if TYPE_CHECKING:
    from patchkit.client.pipeline import Pipeline  # the top layer: a type only

__all__ = ["BACKENDS", "ComponentConfig", "DeploymentConfig"]

BACKENDS = ("local", "inprocess", "ray")
ESTIMATORS = ("average", "xgboost")
POSITIVE_FIELDS = (
    "max_inflight_batches", "max_inflight_requests", "max_body_bytes", "max_inflight_bytes", "read_timeout_s",
    "request_timeout_s", "call_timeout_s", "admission_queue_limit", "autoscale_interval_s", "health_check_period_s",
    "health_check_timeout_s", "health_check_failures",
)
# What `describe()` shows (`GET /v1/plan`): the serving options that are numbers, booleans or names
# of patchkit's own choices. Never the host, paths, addresses, tokens, secrets or environments.
DESCRIBED_FIELDS = (
    "backend", "slo_ms", "batch_wait_ms", "pipelining", "max_inflight_batches", "max_inflight_requests",
    "max_body_bytes", "max_inflight_bytes", "read_timeout_s", "request_timeout_s", "call_timeout_s", "max_retries",
    "health_check_period_s", "health_check_timeout_s", "health_check_failures", "debug", "optional_inputs",
    "drain_timeout_s", "prioritize", "pause_admission", "admission_queue_limit", "estimator", "prefetch", "autoscale",
    "autoscale_interval_s", "scale_up_after_s", "scale_down_after_s", "min_replicas", "max_replicas", "plan",
    "ray_max_restarts", "ray_placement_timeout_s",
)
DESCRIBED_ACTOR_OPTIONS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type")  # not runtime_env
RAY_FIELDS = (
    "ray_address", "ray_max_restarts", "ray_placement_timeout_s", "ray_actor_options", "tls_cert", "tls_key", "tls_ca",
    "tls_server_name",
)


@dataclass(frozen=True)
class ComponentConfig:
    replicas: int
    batch_sizes: dict[str, int]  # per @make method
    resource: str = "cpu"  # what each replica takes `units` of, when a plan placed it
    units: int = 1

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1; got {self.replicas}")
        for method, size in self.batch_sizes.items():
            if size < 1:
                raise ValueError(f"batch size of {method} must be >= 1; got {size}")


@dataclass(frozen=True)
class DeploymentConfig:
    """Everything the front-end needs besides the pipeline. Validated when built."""

    components: dict[str, ComponentConfig]
    backend: str = "local"
    host: str = "127.0.0.1"
    port: int = 0
    slo_ms: float | None = None
    batch_wait_ms: float = 0.0  # a partial batch leaves once its oldest call waited this long
    pipelining: bool = True  # False: requests run in waves, a new one waits until every running one has finished
    max_inflight_batches: int = 2  # per replica: one running, one on the wire
    max_inflight_requests: int = 4096  # admission bound: beyond it, 503 with Retry-After
    max_body_bytes: int = 1 << 20
    max_inflight_bytes: int = 256 << 20  # admission bound on the request bodies in flight: beyond it, 503
    read_timeout_s: float = 30.0  # a request's headers and body must arrive within this, else 408 and the connection closes
    request_timeout_s: float = 300.0  # a request still running after this gets 504
    call_timeout_s: float = 300.0  # a batch running longer (unless its method says otherwise) recycles its replica
    max_retries: int = 2  # times a call is re-sent after the replica running it died (unless its method says otherwise)
    # Health checks of every replica (as Ray Serve's): every period, each must answer within the timeout;
    # after `health_check_failures` failures in a row it is recycled.
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    health_check_failures: int = 3
    debug: bool = False  # error replies carry tracebacks
    log_level: str | None = None  # the front-end process's; None: the level of the deploying process's root logger
    auth_token: str | None = field(default=None, repr=False)  # a bearer token for every route but /healthz; PATCHKIT_AUTH_TOKEN
    optional_inputs: tuple[str, ...] = ()  # inputs a request may leave out (they keep their captured value)
    drain_timeout_s: float = 30.0
    # SLO policies, active for requests with an SLO (the request's slo_ms, else the endpoint's):
    prioritize: bool = True  # calls of requests at risk jump their queues, least slack first
    pause_admission: bool = False  # while a request in flight is at risk, new ones wait in a bounded queue
    admission_queue_limit: int = 1024  # beyond it, 503 with Retry-After
    estimator: str = "average"  # of remaining time: "average" (per graph position) or "xgboost" (xgboost-cpu)
    prefetch: bool = True  # send a retriever's `prefetch` the input of the call its query comes from, as that call starts
    autoscale: bool = True  # add replicas to the bottleneck while requests stay at risk; remove idle ones
    autoscale_interval_s: float = 1.0  # how often the autoscaler looks
    scale_up_after_s: float = 2.0  # requests at risk this long (and this long after a scale-up): one more replica
    scale_down_after_s: float = 30.0  # a component idle this long loses a replica
    min_replicas: int | dict[str, int] | None = None  # for every component, or by name; None: as deployed
    max_replicas: int | dict[str, int] | None = None  # for every component, or by name; None: as resources allow
    plan: dict[str, Any] | None = None  # the Plan applied, as Plan.to_dict(): replicas are placed as it says
    # The ray backend's (see orchestrator/ray_options.py): the cluster, Ray's restarts of a dead actor, how long
    # a replica may wait for resources, Ray actor options by component, and TLS between front-end and workers.
    ray_address: str | None = None
    ray_max_restarts: int = 3
    ray_placement_timeout_s: float = 60.0
    ray_actor_options: dict[str, dict[str, Any]] | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None
    secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}; got {self.backend!r}")
        if self.slo_ms is not None and self.slo_ms <= 0:
            raise ValueError(f"slo_ms must be > 0; got {self.slo_ms}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535; got {self.port}")
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator must be one of {', '.join(map(repr, ESTIMATORS))}; got {self.estimator!r}")
        for name in POSITIVE_FIELDS:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0; got {getattr(self, name)}")
        for name in ("batch_wait_ms", "max_retries", "scale_up_after_s", "scale_down_after_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0; got {getattr(self, name)}")
        self._check_replica_bounds()
        self._check_ray()
        self._check_edge()

    def _check_edge(self) -> None:
        """The HTTP edge's options: the bytes bound holds any one body, timeouts finite, the token a
        non-empty string (PATCHKIT_AUTH_TOKEN when none is given)."""
        if self.max_inflight_bytes < self.max_body_bytes:
            raise ConfigError(f"max_inflight_bytes ({self.max_inflight_bytes}) must be >= max_body_bytes "
                              f"({self.max_body_bytes}): a body of the largest size could never be admitted")
        if not math.isfinite(self.read_timeout_s):
            raise ConfigError(f"read_timeout_s must be a finite number of seconds; got {self.read_timeout_s}")
        if not isinstance(self.debug, bool):
            raise ConfigError(f"debug must be True or False; got {self.debug!r}")
        token = self.auth_token if self.auth_token is not None else envs.auth_token()
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ConfigError("auth_token must be a non-empty string (the bearer token clients send)")
        object.__setattr__(self, "auth_token", token)

    def _check_ray(self) -> None:
        """Ray and TLS options only with backend='ray', valid, and naming known components."""
        options = self.ray_options()
        if self.backend != "ray":
            given = [name for name in RAY_FIELDS if getattr(self, name) != getattr(DeploymentConfig, name, None)]
            if given:
                raise ValueError(f"{given[0]} is an option of backend='ray'; got backend={self.backend!r}")
            return
        _check_names("ray_actor_options", options.actor_options, set(self.components))
        if self.ray_actor_options is not None:
            object.__setattr__(self, "ray_actor_options", {k: dict(v) for k, v in self.ray_actor_options.items()})

    def ray_options(self) -> RayOptions:
        """The ray backend's options, checked (raises ValueError naming the option to fix)."""
        return RayOptions(
            address=self.ray_address,
            max_restarts=self.ray_max_restarts,
            placement_timeout_s=self.ray_placement_timeout_s,
            actor_options=dict(self.ray_actor_options or {}),
            tls_cert=self.tls_cert,
            tls_key=self.tls_key,
            tls_ca=self.tls_ca,
            tls_server_name=self.tls_server_name,
        )

    def _check_replica_bounds(self) -> None:
        """min_replicas <= replicas <= max_replicas for every component; mappings name known components."""
        for field_name in ("min_replicas", "max_replicas"):
            value = getattr(self, field_name)
            _check_names(field_name, value, set(self.components))
            if isinstance(value, Mapping):  # a plain dict, so that describe() stays JSON-able
                object.__setattr__(self, field_name, dict(value))
        for name, component in self.components.items():
            low, high = self.min_replicas_of(name), self.max_replicas_of(name)
            if low < 1:
                raise ValueError(f"min_replicas must be >= 1; got {low} for {name!r}")
            if high is not None and high < low and _names(self.min_replicas, name):  # a default min: the next check says it
                raise ValueError(f"max_replicas ({high}) must be >= min_replicas ({low}) for {name!r}")
            if component.replicas < low:
                raise ValueError(f"replicas ({component.replicas}) must be >= min_replicas ({low}) for {name!r}")
            if high is not None and component.replicas > high:
                raise ValueError(f"replicas ({component.replicas}) must be <= max_replicas ({high}) for {name!r}")

    def min_replicas_of(self, name: str) -> int:
        """The fewest replicas the autoscaler leaves component `name`: its own setting, else as deployed."""
        return _pick(self.min_replicas, (name,), self.components[name].replicas)

    def max_replicas_of(self, name: str) -> int | None:
        """The most replicas the autoscaler gives component `name`; None: as many as resources allow."""
        return _pick(self.max_replicas, (name,), 0) if _names(self.max_replicas, name) else None

    @classmethod
    def resolve(
        cls,
        pipeline: Pipeline,
        *,
        replicas: int | Mapping[str, int] | None = None,
        batch_size: int | Mapping[str, int] | None = None,
        optional_inputs: tuple[str, ...] | list[str] = (),
        plan: Plan | str | None = None,
        **options: Any,
    ) -> DeploymentConfig:
        """Build the config from deploy()'s arguments, naming any component, method or input it does not know.

        `replicas`: one count for every component, or counts by component name. `batch_size`: one
        size for every method, or sizes by component ("retriever") or method ("retriever.retrieve").
        `plan`: replicas, batch sizes and placement of every component, instead of those two.
        """
        components = pipeline.components
        if not components:
            raise InputError("the pipeline calls no component: there is nothing to deploy")
        methods = {f"{name}.{m}": (name, m) for name, c in components.items() for m in make_methods(type(c))}
        _check_names("replicas", replicas, set(components))
        _check_names("batch_size", batch_size, set(components) | set(methods))
        _check_names("optional_inputs", dict.fromkeys(optional_inputs, 0), set(pipeline.inputs))
        if plan is not None:
            return cls._from_plan(pipeline, plan, replicas, batch_size, optional_inputs, options)
        configs = {}
        for name, component in components.items():
            sizes = {}
            for method_name in make_methods(type(component)):
                sizes[method_name] = _pick(batch_size, (f"{name}.{method_name}", name), component.batch_limit(method_name))
            configs[name] = ComponentConfig(replicas=_pick(replicas, (name,), 1), batch_sizes=sizes)
        return cls(components=configs, optional_inputs=tuple(optional_inputs), **options)

    @classmethod
    def _from_plan(
        cls, pipeline: Pipeline, plan: object, replicas: object, batch_size: object, optional_inputs: Any, options: dict[str, Any]
    ) -> DeploymentConfig:
        if replicas is not None or batch_size is not None:
            raise InputError("pass either plan= or replicas=/batch_size=: a plan sets both")
        if not isinstance(plan, Plan):
            raise InputError(f"plan must be 'auto', a Plan, or None; got {plan!r}")
        missing = set(pipeline.components) - set(plan.components)
        _check_names("the plan", dict(plan.components), set(pipeline.components))
        if missing:
            raise InputError(f"the plan has no entry for {', '.join(sorted(missing))}; plan the same pipeline")
        configs = {
            name: ComponentConfig(
                replicas=c.replicas,
                batch_sizes=dict.fromkeys(make_methods(type(pipeline.components[name])), c.batch_size),
                resource=c.resource,
                units=c.units,
            )
            for name, c in plan.components.items()
        }
        return cls(components=configs, optional_inputs=tuple(optional_inputs), plan=plan.to_dict(), **options)

    def describe(self) -> dict[str, Any]:
        """The plan the front-end runs, for `GET /v1/plan`: an allow-list of fields (`DESCRIBED_FIELDS`),
        so that nothing added to the config later (a path, a key, an environment) is served by default.
        Of `ray_actor_options` only the resources each component asks for."""
        data: dict[str, Any] = {name: getattr(self, name) for name in DESCRIBED_FIELDS}
        data["components"] = {name: asdict(component) for name, component in self.components.items()}
        if self.ray_actor_options is not None:
            data["ray_actor_options"] = {
                name: {key: value for key, value in options.items() if key in DESCRIBED_ACTOR_OPTIONS}
                for name, options in self.ray_actor_options.items()
            }
        return data


def _check_names(argument: str, value: object, known: set[str]) -> None:
    if not isinstance(value, Mapping):
        return
    for name in value:
        if name not in known:
            close = difflib.get_close_matches(str(name), sorted(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            known_names = ", ".join(sorted(known))
            raise InputError(f"{argument} names {name!r}, which the pipeline does not have{hint} (known: {known_names})")


def _names(value: int | Mapping[str, int] | None, name: str) -> bool:
    """Whether a setting for every component, or by name, sets one for `name`."""
    return value is not None and (not isinstance(value, Mapping) or name in value)


def _pick(value: int | Mapping[str, int] | None, keys: tuple[str, ...], default: int) -> int:
    if value is None:
        return default
    if not isinstance(value, Mapping):
        return int(value)
    for key in keys:
        if key in value:
            return int(value[key])
    return default
