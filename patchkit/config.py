"""How a deployment is configured: per component, its replicas and per-method batch sizes.

`DeploymentConfig.resolve` turns deploy()'s arguments into a config: replicas and batch sizes come
from a `Plan` when one is given, else from the arguments or the components' own defaults
(`@make(max_batch_size=...)`).
"""

from __future__ import annotations

import difflib
import logging
import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, cast

from patchkit import envs
from patchkit.component import make_methods
from patchkit.errors import ConfigError, InputError
from patchkit.orchestrator.ray_options import RayOptions
from patchkit.orchestrator.resources import SHARES_PER_CORE
from patchkit.scheduler.offline.plan import Plan

if TYPE_CHECKING:
    from patchkit.client.pipeline import Pipeline  # the top layer: a type only

__all__ = ["BACKENDS", "LOG_LEVELS", "ComponentConfig", "DeploymentConfig"]

BACKENDS = ("local", "inprocess", "ray")
ESTIMATORS = ("average", "xgboost")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
POSITIVE_FIELDS = (
    "max_inflight_batches", "max_inflight_requests", "max_body_bytes", "max_inflight_bytes", "read_timeout_s",
    "request_timeout_s", "call_timeout_s", "abandoned_grace_s", "admission_queue_limit", "autoscale_interval_s",
    "health_check_period_s", "health_check_timeout_s", "health_check_failures",
)
# What `describe()` shows (`GET /v1/plan`): the serving options that are numbers, booleans or names
# of patchkit's own choices. Never the host, paths, addresses, tokens, secrets or environments.
DESCRIBED_FIELDS = (
    "backend", "slo_ms", "batch_wait_ms", "pipelining", "max_inflight_batches", "max_inflight_requests",
    "max_body_bytes", "max_inflight_bytes", "read_timeout_s", "request_timeout_s", "call_timeout_s", "abandoned_grace_s",
    "max_retries", "health_check_period_s", "health_check_timeout_s", "health_check_failures", "debug", "optional_inputs",
    "drain_timeout_s", "prioritize", "pause_admission", "admission_queue_limit", "estimator", "prefetch", "autoscale",
    "autoscale_interval_s", "scale_up_after_s", "scale_down_after_s", "min_replicas", "max_replicas", "plan",
    "ray_max_restarts", "ray_placement_timeout_s", "tls", "log_level", "name", "chat_input", "chat_output",
)
DESCRIBED_ACTOR_OPTIONS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type")  # not runtime_env
NON_NEGATIVE_FIELDS = ("batch_wait_ms", "max_retries", "scale_up_after_s", "scale_down_after_s", "drain_timeout_s")
RAY_FIELDS = (
    "ray_address", "ray_max_restarts", "ray_placement_timeout_s", "ray_actor_options", "tls", "tls_cert", "tls_key",
    "tls_ca", "tls_server_name",
)
# Fields deploy() fills itself: not options a user passes.
INTERNAL_FIELDS = ("components", "plan", "secret")


@dataclass(frozen=True)
class ComponentConfig:
    replicas: int
    batch_sizes: dict[str, int]  # per @make method; of a max_concurrency method, its calls at once per replica
    resource: str = "cpu"  # what each replica takes `units` of, when a plan placed it
    units: int = SHARES_PER_CORE  # shares of a core on "cpu" (SHARES_PER_CORE: one core), GPUs on "gpu"

    def __post_init__(self) -> None:
        if not _is_int(self.replicas) or self.replicas < 1:
            raise ConfigError(f"replicas must be an integer >= 1; got {self.replicas!r}")
        for method, size in self.batch_sizes.items():
            if not _is_int(size) or size < 1:
                raise ConfigError(f"batch size of {method} must be an integer >= 1; got {size!r}")


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
    # A batch whose every call belongs to a request that has ended, still running this long past the latest of their
    # deadlines, serves nobody: its replica is recycled as on a call timeout. Long enough for a healthy call to come
    # back once told its request ended (a stream=True method stops at its next chunk, a call not reached is skipped);
    # short, since the calls queued behind it wait that long too.
    abandoned_grace_s: float = 5.0
    max_retries: int = 2  # times a call is re-sent after the replica running it died (unless its method says otherwise)
    # Health checks of every replica (as Ray Serve's): every period, each must answer within the timeout;
    # after `health_check_failures` failures in a row it is recycled.
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    health_check_failures: int = 3
    debug: bool = False  # error replies carry tracebacks
    # The front-end's and the workers' (DEBUG, INFO, WARNING, ERROR); None: as the deploying process's `patchkit`
    # logger (its effective level), which `resolve` reads.
    log_level: str | None = None
    auth_token: str | None = field(default=None, repr=False)  # a bearer token for every route but /healthz; PATCHKIT_AUTH_TOKEN
    optional_inputs: tuple[str, ...] = ()  # inputs a request may leave out (they keep their captured value)
    drain_timeout_s: float = 30.0
    # The OpenAI chat API (server/chat.py): the model name `GET /v1/models` lists; the input the last user message
    # fills (None: the pipeline's one input); the field of a dict output that is the assistant's message.
    name: str = "patchkit"
    chat_input: str | None = None
    chat_output: str | None = None
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
    tls: bool = True  # False: plaintext gRPC to the workers; else tls_cert/tls_key, or a per-deployment certificate
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None
    secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        """Every option checked where it is given: a ConfigError naming it, its value, and what it may be."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in INTERNAL_FIELDS}
        _check_values(values)
        if self.log_level is not None:
            object.__setattr__(self, "log_level", self.log_level.upper())
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
            return
        _check_names("ray_actor_options", options.actor_options, set(self.components))
        if self.ray_actor_options is not None:
            object.__setattr__(self, "ray_actor_options", {k: dict(v) for k, v in self.ray_actor_options.items()})

    def ray_options(self) -> RayOptions:
        """The ray backend's options, checked (raises ConfigError naming the option to fix)."""
        return _ray_options({name: getattr(self, name) for name in RAY_FIELDS})

    def _check_replica_bounds(self) -> None:
        """min_replicas <= replicas <= max_replicas for every component; mappings name known components."""
        for field_name in ("min_replicas", "max_replicas"):
            value = getattr(self, field_name)
            _check_names(field_name, value, set(self.components))
            if isinstance(value, Mapping):  # a plain dict, so that describe() stays JSON-able
                object.__setattr__(self, field_name, dict(value))
        for name, component in self.components.items():
            low, high = self.min_replicas_of(name), self.max_replicas_of(name)
            if high is not None and high < low and _names(self.min_replicas, name):  # a default min: the next check says it
                raise ConfigError(f"max_replicas ({high}) must be >= min_replicas ({low}) for {name!r}")
            if component.replicas < low:
                raise ConfigError(f"replicas ({component.replicas}) must be >= min_replicas ({low}) for {name!r}")
            if high is not None and component.replicas > high:
                raise ConfigError(f"replicas ({component.replicas}) must be <= max_replicas ({high}) for {name!r}")

    def min_replicas_of(self, name: str) -> int:
        """The fewest replicas the autoscaler leaves component `name`: its own setting, else as deployed."""
        return _pick(self.min_replicas, (name,), self.components[name].replicas)

    def max_replicas_of(self, name: str) -> int | None:
        """The most replicas the autoscaler gives component `name`; None: as many as resources allow."""
        return _pick(self.max_replicas, (name,), 0) if _names(self.max_replicas, name) else None

    @classmethod
    def check_options(cls, options: Mapping[str, Any], known: Iterable[str] = (), /) -> None:
        """Check options on their own, before there is a pipeline (`patchkit serve` checks its flags before it
        runs the script): each name, type and range, and conflicts between them. Raises ConfigError."""
        _check_option_names(options, known)
        _check_values(options)
        _ray_options(options)

    @classmethod
    def check_arguments(
        cls,
        pipeline: Pipeline,
        known: Iterable[str] = (),
        /,
        *,
        replicas: object = None,
        batch_size: object = None,
        optional_inputs: object = (),
        plan: object = None,
        **options: Any,
    ) -> None:
        """Check deploy()'s (or `patchkit serve`'s) arguments before anything is planned or started.

        Called by `deploy()` first thing and by `resolve`. Raises a ConfigError naming the option:
        an unknown name (with the closest known one, `known` adding the caller's own parameters), a
        value of the wrong type or out of range, a component, method or input the pipeline does not
        have, or two options that conflict (with both values). Conflicts that need the replicas a
        plan gives are checked when the config is built.
        """
        cls.check_options(options, known)
        components = set(pipeline.components)
        methods = {f"{name}.{m}" for name, c in pipeline.components.items() for m in make_methods(type(c))}
        _check_counts("replicas", replicas)
        _check_counts("batch_size", batch_size)
        _check_names("replicas", replicas, components)
        _check_names("batch_size", batch_size, components | methods)
        for name in ("min_replicas", "max_replicas"):
            _check_names(name, options.get(name), components)
        if options.get("backend") == "ray":
            _check_names("ray_actor_options", options.get("ray_actor_options"), components)
        if isinstance(optional_inputs, str) or not isinstance(optional_inputs, Iterable):
            raise ConfigError(f"optional_inputs must be a list of input names, such as ['topk']; got {optional_inputs!r}")
        _check_names("optional_inputs", dict.fromkeys(optional_inputs, 0), set(pipeline.inputs))
        _check_chat_input(options.get("chat_input"), pipeline.inputs)
        if plan is None:
            return
        if isinstance(plan, str):
            if plan != "auto":
                raise ConfigError(f"plan must be 'auto', a Plan, or None; got {plan!r}{_hint(plan, ['auto'])}")
        elif not isinstance(plan, Plan):
            raise ConfigError(f"plan must be 'auto', a Plan, or None; got {type(plan).__name__} {plan!r:.100}")
        if replicas is not None or batch_size is not None:
            given = f"replicas={replicas!r}" if replicas is not None else f"batch_size={batch_size!r}"
            shown = "'auto'" if plan == "auto" else "a Plan"
            raise ConfigError(f"pass either plan= or replicas=/batch_size=: a plan sets both (got plan={shown} and {given})")

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
        `log_level` left out is the deploying process's: the effective level of its `patchkit` logger.
        Raises ConfigError for an option to fix (see `check_arguments`).
        """
        components = pipeline.components
        if not components:
            raise InputError("the pipeline calls no component: there is nothing to deploy")
        secret = options.pop("secret", "")
        cls.check_arguments(
            pipeline, replicas=replicas, batch_size=batch_size, optional_inputs=optional_inputs, plan=plan, **options
        )
        if options.get("log_level") is None:
            options["log_level"] = _level_name(logging.getLogger("patchkit").getEffectiveLevel())
        options["secret"] = secret
        if plan is not None:
            return cls._from_plan(pipeline, plan, optional_inputs, options)
        configs = {}
        for name, component in components.items():
            sizes = {}
            for method_name in make_methods(type(component)):
                sizes[method_name] = _pick(batch_size, (f"{name}.{method_name}", name), component.batch_limit(method_name))
            configs[name] = ComponentConfig(replicas=_pick(replicas, (name,), 1), batch_sizes=sizes)
        return cls(components=configs, optional_inputs=tuple(optional_inputs), **options)

    @classmethod
    def _from_plan(cls, pipeline: Pipeline, plan: object, optional_inputs: Any, options: dict[str, Any]) -> DeploymentConfig:
        if not isinstance(plan, Plan):  # 'auto' is deploy()'s to turn into a Plan
            raise ConfigError(f"plan must be a Plan here (deploy() and `patchkit serve` plan for 'auto'); got {plan!r}")
        missing = set(pipeline.components) - set(plan.components)
        _check_names("the plan", dict(plan.components), set(pipeline.components))
        if missing:
            raise ConfigError(f"the plan has no entry for {', '.join(sorted(missing))}; plan the same pipeline")
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


# -- checks: each raises a ConfigError naming the option, its value, and what it may be ------------------------------
# The arguments of `resolve` beside the fields: names a misspelt option may be close to.
ARGUMENTS = ("replicas", "batch_size", "optional_inputs", "plan")
_DESCRIBED = {"int": "an integer", "float": "a finite number", "bool": "True or False", "str": "a string"}


def _hint(given: object, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(str(given), sorted(known), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_option_names(options: Mapping[str, Any], known: Iterable[str]) -> None:
    allowed = {f.name for f in fields(DeploymentConfig)} - set(INTERNAL_FIELDS)
    for name in options:
        if name not in allowed:
            hint = _hint(name, allowed | set(ARGUMENTS) | set(known)) or " (the options are DeploymentConfig's fields)"
            raise ConfigError(f"unknown option {name!r}{hint}")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_type(value: object, kind: str) -> bool:
    if kind == "int":
        return _is_int(value)
    if kind == "float":
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "bool":
        return isinstance(value, bool)
    return isinstance(value, str)


def _check_type(name: str, value: object) -> None:
    """The simple annotations (int, float, bool, str, each maybe `| None`); compound ones have rules of their own."""
    kinds = [part.strip() for part in str(_ANNOTATIONS[name]).split("|")]
    if value is None and "None" in kinds:
        return
    simple = [kind for kind in kinds if kind != "None"]
    if not all(kind in _DESCRIBED for kind in simple) or any(_is_type(value, kind) for kind in simple):
        return
    wanted = " or ".join(_DESCRIBED[kind] for kind in simple) + (" or None" if "None" in kinds else "")
    raise ConfigError(f"{name} must be {wanted}; got {value!r}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}{_hint(value, choices)}")


def _check_values(values: Mapping[str, Any]) -> None:
    """Each option given on its own: its type and range. `values` maps option names to what was given."""
    for name, value in values.items():
        _check_type(name, value)
    for name in POSITIVE_FIELDS:
        if name in values and values[name] <= 0:
            raise ConfigError(f"{name} must be > 0; got {values[name]!r}")
    for name in NON_NEGATIVE_FIELDS:
        if name in values and values[name] < 0:
            raise ConfigError(f"{name} must be >= 0; got {values[name]!r}")
    if "backend" in values:
        _check_choice("backend", values["backend"], BACKENDS)
    if "estimator" in values:
        _check_choice("estimator", values["estimator"], ESTIMATORS)
    if values.get("log_level") is not None:
        level, shown = values["log_level"], tuple(name.lower() for name in LOG_LEVELS)
        if level.upper() not in LOG_LEVELS:
            hint = _hint(level.lower(), shown)
            raise ConfigError(f"log_level must be one of {', '.join(map(repr, shown))}; got {level!r}{hint}")
    if values.get("slo_ms") is not None and values["slo_ms"] <= 0:
        raise ConfigError(f"slo_ms must be > 0; got {values['slo_ms']!r}")
    for name in ("name", "chat_input", "chat_output"):
        if isinstance(values.get(name), str) and not values[name].strip():
            raise ConfigError(f"{name} must be a non-empty string; got {values[name]!r}")
    if "port" in values and not 0 <= values["port"] <= 65535:
        raise ConfigError(f"port must be in 0..65535; got {values['port']!r}")
    if "host" in values and not values["host"].strip():
        raise ConfigError(f"host must be an address to listen on, such as '127.0.0.1' or '0.0.0.0'; got {values['host']!r}")
    if "optional_inputs" in values:
        given = values["optional_inputs"]
        if isinstance(given, str) or not isinstance(given, Iterable) or not all(isinstance(n, str) for n in given):
            raise ConfigError(f"optional_inputs must be a list of input names, such as ['topk']; got {given!r}")
    for name in ("min_replicas", "max_replicas"):
        _check_counts(name, values.get(name))
    backend = values.get("backend", "local")
    if backend != "ray":  # a ray option given for another backend is a mistake, not something to ignore
        for name in RAY_FIELDS:
            if name in values and values[name] != _DEFAULTS[name]:
                raise ConfigError(f"{name} is an option of backend='ray'; got backend={backend!r} and {name}={values[name]!r}")


def _check_chat_input(chat_input: object, inputs: Mapping[str, Any]) -> None:
    """`chat_input` names a text input of the pipeline (a str, or None, at capture)."""
    if not isinstance(chat_input, str):
        return  # None, or a wrong type `_check_values` names
    if chat_input not in inputs:
        known = ", ".join(sorted(inputs)) or "none"
        raise ConfigError(f"chat_input names {chat_input!r}, which is not an input of the pipeline{_hint(chat_input, inputs)} "
                          f"(its inputs: {known})")
    default = inputs[chat_input]
    if default is not None and not isinstance(default, str):
        raise ConfigError(f"chat_input {chat_input!r} must be a text input, which a user message fills; it was a "
                          f"{type(default).__name__} at capture ({default!r:.40})")


def _check_counts(argument: str, value: object) -> None:
    """`replicas`, `batch_size`, `min_replicas`, `max_replicas`: None, an integer >= 1, or such integers by name."""
    if value is None:
        return
    items = value.items() if isinstance(value, Mapping) else [(None, value)]
    for key, count in items:
        where = argument if key is None else f"{argument}[{key!r}]"
        if not _is_int(count):
            by_name = "" if key is not None else " or a dict of them by name"
            raise ConfigError(f"{where} must be an integer >= 1{by_name}; got {count!r}")
        if cast(int, count) < 1:
            raise ConfigError(f"{where} must be >= 1; got {count!r}")


def _ray_options(values: Mapping[str, Any]) -> RayOptions:
    """The ray backend's options among `values` (defaults for the others), checked."""
    def get(name: str) -> Any:
        return values.get(name, _DEFAULTS[name])

    actor_options = get("ray_actor_options") or {}
    return RayOptions(
        address=get("ray_address"),
        max_restarts=get("ray_max_restarts"),
        placement_timeout_s=get("ray_placement_timeout_s"),
        actor_options=dict(actor_options) if isinstance(actor_options, Mapping) else actor_options,  # else: says so
        tls=get("tls"),
        tls_cert=get("tls_cert"),
        tls_key=get("tls_key"),
        tls_ca=get("tls_ca"),
        tls_server_name=get("tls_server_name"),
    )


def _level_name(level: int) -> str:
    """The standard level at or below `level` (a custom 15 logs what DEBUG would): what a process logs at."""
    below = [name for name in LOG_LEVELS if logging.getLevelName(name) <= level]
    return below[-1] if below else "DEBUG"


def _check_names(argument: str, value: object, known: set[str]) -> None:
    if not isinstance(value, Mapping):
        return
    for name in value:
        if name not in known:
            known_names = ", ".join(sorted(known))
            raise ConfigError(
                f"{argument} names {name!r}, which the pipeline does not have{_hint(name, known)} (known: {known_names})"
            )


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


_ANNOTATIONS = {f.name: f.type for f in fields(DeploymentConfig)}
_DEFAULTS = {f.name: f.default for f in fields(DeploymentConfig)}
