"""How a deployment is configured.

Per component, its replicas and per-method batch sizes, and deploy()'s options in their groups.

`DeploymentConfig.resolve` turns deploy()'s arguments into a config: replicas and batch sizes come
from a `Plan` when one is given, else from the arguments or the components' own defaults
(`@make(max_batch_size=...)`), an engine's replicas from the cores (`machine.py`); the flat options
(`port=`, `slo_ms=`, `ray_address=`) fill the groups.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, cast

from patchkit.config.groups import (
    BACKENDS,
    LOG_LEVELS,
    AutoscalingConfig,
    ChatConfig,
    LimitsConfig,
    LivenessConfig,
    RayConfig,
    ServerConfig,
    SloConfig,
)
from patchkit.config.machine import unplanned_plan
from patchkit.config.options import check_counts, check_names, check_value, close_hint, collect, is_int, option
from patchkit.core import Component, make_methods
from patchkit.errors import ConfigError, InputError
from patchkit.orchestrator.resources import SHARES_PER_CORE
from patchkit.program.identity import deployed_names
from patchkit.scheduler.offline.plan import Plan

if TYPE_CHECKING:
    from patchkit.orchestrator.ray_options import RayOptions
    from patchkit.program.pipeline import Pipeline  # the top layer: a type only

__all__ = ["OPTIONS", "ComponentConfig", "DeploymentConfig", "check_pipeline_name", "served_components"]


@dataclass(frozen=True)
class ComponentConfig:
    """One component's size in a deployment, validated when built.

    Attributes:
        replicas: how many replicas run it.
        batch_sizes: by `@make` method, its batch size; of a `max_concurrency` method, its calls at once per replica.
        resource: what each replica takes `units` of, when a plan placed it ("cpu" or "gpu").
        units: shares of a core on "cpu" (SHARES_PER_CORE: one core), GPUs on "gpu".

    Raises:
        ConfigError: a count below 1.
    """

    replicas: int
    batch_sizes: dict[str, int]  # per @make method; of a max_concurrency method, its calls at once per replica
    resource: str = "cpu"  # what each replica takes `units` of, when a plan placed it
    units: int = SHARES_PER_CORE  # shares of a core on "cpu" (SHARES_PER_CORE: one core), GPUs on "gpu"

    def __post_init__(self) -> None:
        if not is_int(self.replicas) or self.replicas < 1:
            raise ConfigError(f"replicas must be an integer >= 1; got {self.replicas!r}")
        for method, size in self.batch_sizes.items():
            if not is_int(size) or size < 1:
                raise ConfigError(f"batch size of {method} must be an integer >= 1; got {size!r}")


@dataclass(frozen=True)
class DeploymentConfig:
    """Everything the front-end needs besides the pipeline, validated when built.

    The components' sizes, the backend, and the options by group (`config.server.port`, `config.slo.slo_ms`,
    `config.ray.address`). `OPTIONS` maps each option's flat name, the one users pass, to where it lives.
    Built by `resolve` from deploy()'s arguments; each group is a frozen dataclass of options.

    Attributes:
        components: each component's `ComponentConfig`, by its deployed name.
        backend: "local", "inprocess" or "ray".
        server: the HTTP server (`ServerConfig`).
        limits: what may be in flight, batching and admission (`LimitsConfig`).
        liveness: timeouts, retries, health checks and draining (`LivenessConfig`).
        slo: the latency target and its policies (`SloConfig`).
        autoscaling: the autoscaler's bounds and pace (`AutoscalingConfig`).
        ray: the ray backend's options (`RayConfig`).
        chat: the OpenAI chat API (`ChatConfig`).
        plan: the Plan applied, as `Plan.to_dict()` (None: none).

    Raises:
        ConfigError: an option out of range, or two that conflict (naming both values).
    """

    components: dict[str, ComponentConfig]
    backend: str = option("local", help="'local' (a process per replica), 'inprocess' (a thread of this process) or "
                          "'ray' (Ray actors across a cluster)", choices=BACKENDS, described=True, flag=True)
    server: ServerConfig = field(default_factory=ServerConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    liveness: LivenessConfig = field(default_factory=LivenessConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    autoscaling: AutoscalingConfig = field(default_factory=AutoscalingConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    # Filled by deploy(), not options: the Plan applied (as Plan.to_dict(): replicas are placed as it says), and
    # the secret every RPC of a cluster backend carries.
    plan: dict[str, Any] | None = None
    secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        """Check the options not in a group, then the rules across groups and components.

        Each group checked itself as it was built. Raises a ConfigError naming the option, its value, and what it may be.
        """
        for spec in OPTIONS.values():
            if spec.group is None:
                check_value(spec, spec.value_of(self))
        _check_backend_options(self.backend, {name: spec.value_of(self) for name, spec in OPTIONS.items()})
        self._check_replica_bounds()
        if self.backend == "ray":
            _check_names("ray_actor_options", self.ray.actor_options, set(self.components))

    def ray_options(self) -> RayOptions:
        """The ray backend's options as the orchestrator takes them (checked when the config was built)."""
        return self.ray.options()

    def _check_replica_bounds(self) -> None:
        """min_replicas <= replicas <= max_replicas for every component; mappings name known components."""
        for name in ("min_replicas", "max_replicas"):
            _check_names(name, getattr(self.autoscaling, name), set(self.components))
        for name, component in self.components.items():
            low, high = self.min_replicas_of(name), self.max_replicas_of(name)
            if high is not None and high < low and _names(self.autoscaling.min_replicas, name):  # else: the next check
                raise ConfigError(f"max_replicas ({high}) must be >= min_replicas ({low}) for {name!r}")
            if component.replicas < low:
                raise ConfigError(f"replicas ({component.replicas}) must be >= min_replicas ({low}) for {name!r}")
            if high is not None and component.replicas > high:
                raise ConfigError(f"replicas ({component.replicas}) must be <= max_replicas ({high}) for {name!r}")

    def min_replicas_of(self, name: str) -> int:
        """The fewest replicas the autoscaler leaves component `name`: its own setting, else as deployed."""
        return _pick(self.autoscaling.min_replicas, (name,), self.components[name].replicas)

    def max_replicas_of(self, name: str) -> int | None:
        """The most replicas the autoscaler gives component `name`; None: as many as resources allow."""
        most = self.autoscaling.max_replicas
        return _pick(most, (name,), 0) if _names(most, name) else None

    def carry(self, replaced: str, name: str, sizes: ComponentConfig) -> None:
        """Give component `name`, a new version of component `replaced`, its sizes and options.

        `sizes`, and every per-component option `replaced` has by name (`min_replicas`, `max_replicas`,
        `ray_actor_options`, in the dicts the ray backend reads too). Called by the deployment as an update
        adds `name`, so that what was set at deploy holds however many versions follow.
        """
        self.components[name] = sizes
        for by_name in self._by_component():
            if replaced in by_name:
                by_name[name] = by_name[replaced]

    def drop(self, name: str) -> None:
        """Forget component `name`, which left the deployment: its sizes and its per-component options."""
        self.components.pop(name, None)
        for by_name in self._by_component():
            by_name.pop(name, None)

    def _by_component(self) -> list[dict[str, Any]]:
        """The options set by component name, as the plain dicts their groups keep (each group's `check`)."""
        values = (self.autoscaling.min_replicas, self.autoscaling.max_replicas, self.ray.actor_options)
        return [value for value in values if isinstance(value, dict)]

    @classmethod
    def check_options(cls, options: Mapping[str, Any], known: Iterable[str] = (), /) -> None:
        """Check options on their own, before there is a pipeline (`patchkit serve` checks its flags before it runs the script).

        Each name, type and range, and conflicts between them. Raises ConfigError.
        """
        _check_option_names(options, known)
        _grouped(options)

    @classmethod
    def check_arguments(
        cls,
        pipeline: Pipeline | Mapping[str, Pipeline],
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
        for name in pipeline if isinstance(pipeline, Mapping) else ():
            check_pipeline_name(name)
        names = set(pipeline) if isinstance(pipeline, Mapping) else {options.get("name", "patchkit")}
        for name in ("slo_ms", "priority"):
            if isinstance(options.get(name), Mapping):
                _check_names(name, options[name], names)
        served, inputs = served_components(pipeline), served_inputs(pipeline)
        components = set(served)
        methods = {f"{name}.{m}" for name, c in served.items() for m in make_methods(type(c))}
        check_counts("replicas", replicas)
        check_counts("batch_size", batch_size)
        _check_names("replicas", replicas, components)
        _check_names("batch_size", batch_size, components | methods)
        for name in ("min_replicas", "max_replicas"):
            _check_names(name, options.get(name), components)
        if options.get("backend") == "ray":
            _check_names("ray_actor_options", options.get("ray_actor_options"), components)
        check_names("optional_inputs", optional_inputs)
        _check_names("optional_inputs", dict.fromkeys(cast(Iterable[str], optional_inputs), 0), set(inputs))
        _check_chat_input(options.get("chat_input"), inputs)
        if plan is None:
            return
        if isinstance(plan, str):
            if plan != "auto":
                raise ConfigError(f"plan must be 'auto', a Plan, or None; got {plan!r}{close_hint(plan, ['auto'])}")
        elif not isinstance(plan, Plan):
            raise ConfigError(f"plan must be 'auto', a Plan, or None; got {type(plan).__name__} {plan!r:.100}")
        if replicas is not None or batch_size is not None:
            given = f"replicas={replicas!r}" if replicas is not None else f"batch_size={batch_size!r}"
            shown = "'auto'" if plan == "auto" else "a Plan"
            raise ConfigError(f"pass either plan= or replicas=/batch_size=: a plan sets both (got plan={shown} and {given})")

    @classmethod
    def resolve(
        cls,
        pipeline: Pipeline | Mapping[str, Pipeline],
        *,
        replicas: int | Mapping[str, int] | None = None,
        batch_size: int | Mapping[str, int] | None = None,
        optional_inputs: tuple[str, ...] | list[str] = (),
        plan: Plan | str | None = None,
        **options: Any,
    ) -> DeploymentConfig:
        """Build the config from deploy()'s arguments, naming any component, method or input it does not know.

        `pipeline`: the one served, or several by name, whose components are named as one deployment names
        them (`patchkit.program.identity.deployed_names`).
        `replicas`: one count for every component, or counts by component name. `batch_size`: one
        size for every method, or sizes by component ("retriever") or method ("retriever.retrieve").
        `plan`: replicas, batch sizes and placement of every component, instead of those two.
        `options`: the flat options (`port=`, `ray_address=`), which fill the groups.
        `log_level` left out is the deploying process's: the effective level of its `patchkit` logger.
        Raises ConfigError for an option to fix (see `check_arguments`).
        """
        components = served_components(pipeline)
        if not components:
            raise InputError("the pipeline calls no component: there is nothing to deploy")
        secret = options.pop("secret", "")
        cls.check_arguments(
            pipeline, replicas=replicas, batch_size=batch_size, optional_inputs=optional_inputs, plan=plan, **options
        )
        if options.get("log_level") is None:
            options["log_level"] = _level_name(logging.getLogger("patchkit").getEffectiveLevel())
        grouped = _grouped({**options, "optional_inputs": tuple(optional_inputs)})
        if plan is not None:
            if not isinstance(plan, Plan):  # 'auto' is deploy()'s to turn into a Plan
                raise ConfigError(f"plan must be a Plan here (deploy() and `patchkit serve` plan for 'auto'); got {plan!r}")
            return cls(components=_planned(components, plan), plan=plan.to_dict(), secret=secret, **grouped)
        sized = None if replicas is not None or batch_size is not None else unplanned_plan(components, options)
        configs = {}
        for name, component in components.items():
            sizes = {}
            for method_name in make_methods(type(component)):
                sizes[method_name] = _pick(batch_size, (f"{name}.{method_name}", name), component.batch_limit(method_name))
            if sized is not None:  # the machine's layout; each method keeps its own batch size
                part = sized.components[name]
                configs[name] = ComponentConfig(replicas=part.replicas, batch_sizes=sizes, resource="cpu", units=part.units)
            else:
                configs[name] = ComponentConfig(replicas=_pick(replicas, (name,), 1), batch_sizes=sizes)
        return cls(components=configs, secret=secret, plan=None if sized is None else sized.to_dict(), **grouped)

    def describe(self) -> dict[str, Any]:
        """The plan the front-end runs, for `GET /v1/plan`, by flat option name.

        Only the options whose metadata says `described` (an allow-list, so that nothing added later, a path, a key, an
        environment, is served by default), each as it says; the components' sizes; the Plan applied.
        """
        data: dict[str, Any] = {}
        for name, spec in OPTIONS.items():
            shown = spec.option.described
            if shown is True:
                data[name] = spec.value_of(self)
            elif shown is not False and (value := shown(spec.value_of(self))) is not None:
                data[name] = value
        data["plan"] = self.plan
        data["components"] = {name: asdict(component) for name, component in self.components.items()}
        return data


PIPELINE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a URL path segment and an OpenAI model id as it is


def check_pipeline_name(name: object) -> None:
    """A pipeline's name: 1 to 64 letters, digits, '.', '_' or '-', the first a letter or digit."""
    if not isinstance(name, str) or not PIPELINE_NAME.fullmatch(name):
        raise ConfigError(f"a pipeline's name is 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or "
                          f"digit (it is a URL path segment and a model id); got {name!r:.80}")


def served_components(pipelines: Pipeline | Mapping[str, Pipeline]) -> dict[str, Component]:
    """The components a deployment of `pipelines` (one, or several by name) serves, by their deployed names."""
    named = pipelines if isinstance(pipelines, Mapping) else {"": pipelines}
    return deployed_names({name: pipeline.components for name, pipeline in named.items()})


def served_inputs(pipelines: Pipeline | Mapping[str, Pipeline]) -> dict[str, Any]:
    """The inputs of `pipelines` (one, or several by name), all together."""
    named = pipelines if isinstance(pipelines, Mapping) else {"": pipelines}
    return {key: value for pipeline in named.values() for key, value in pipeline.inputs.items()}


def _planned(components: Mapping[str, Component], plan: Plan) -> dict[str, ComponentConfig]:
    """Every component's replicas, batch size and placement as the plan gives them."""
    missing = set(components) - set(plan.components)
    _check_names("the plan", dict(plan.components), set(components))
    if missing:
        raise ConfigError(f"the plan has no entry for {', '.join(sorted(missing))}; plan the same pipeline")
    return {
        name: ComponentConfig(
            replicas=c.replicas,
            batch_sizes=dict.fromkeys(make_methods(type(components[name])), c.batch_size),
            resource=c.resource,
            units=c.units,
        )
        for name, c in plan.components.items()
    }


def _grouped(options: Mapping[str, Any]) -> dict[str, Any]:
    """Flat options (their names known) as DeploymentConfig's keyword arguments.

    Its own options checked, and each group built from its options, which checks them; a group's options given for another backend
    are refused first, as the mistake to name.
    """
    own: dict[str, Any] = {}
    given: dict[str, dict[str, Any]] = {group: {} for group in GROUPS}
    for name, value in options.items():
        spec = OPTIONS[name]
        (own if spec.group is None else given[spec.group])[spec.field] = value
    for spec in OPTIONS.values():
        if spec.group is None:
            check_value(spec, own.get(spec.field, spec.default))
    _check_backend_options(own.get("backend", OPTIONS["backend"].default), options)
    return {**own, **{group: kind(**given[group]) for group, kind in GROUPS.items()}}


# -- checks: each raises a ConfigError naming the option, its value, and what it may be ------------------------------
# The arguments of `resolve` beside the options (its keyword parameters): names a misspelt option may be close to.
ARGUMENTS = tuple(name for name, parameter in inspect.signature(DeploymentConfig.resolve).parameters.items()
                  if parameter.kind is inspect.Parameter.KEYWORD_ONLY)


def _check_option_names(options: Mapping[str, Any], known: Iterable[str]) -> None:
    for name in options:
        if name not in OPTIONS:
            hint = close_hint(name, set(OPTIONS) | set(ARGUMENTS) | set(known)) or " (help(patchkit.deploy) lists the options)"
            raise ConfigError(f"unknown option {name!r}{hint}")


def _check_backend_options(backend: str, values: Mapping[str, Any]) -> None:
    """An option of a group that belongs to one backend (RayConfig's), given for another, is a mistake, not something to ignore.

    `values` maps flat names to what was given (or is held).
    """
    for name, spec in OPTIONS.items():
        owner = GROUPS[spec.group].backend if spec.group is not None else None
        if owner is not None and owner != backend and name in values and values[name] != spec.default:
            raise ConfigError(f"{name} is an option of backend={owner!r}; got backend={backend!r} and {name}={values[name]!r}")


def _check_chat_input(chat_input: object, inputs: Mapping[str, Any]) -> None:
    """`chat_input` names a text input of the pipeline (a str, or None, at capture)."""
    if not isinstance(chat_input, str):
        return  # None, or a wrong type the chat group names
    if chat_input not in inputs:
        known = ", ".join(sorted(inputs)) or "none"
        raise ConfigError(f"chat_input names {chat_input!r}, which is not an input of the pipeline"
                          f"{close_hint(chat_input, inputs)} (its inputs: {known})")
    default = inputs[chat_input]
    if default is not None and not isinstance(default, str):
        raise ConfigError(f"chat_input {chat_input!r} must be a text input, which a user message fills; it was a "
                          f"{type(default).__name__} at capture ({default!r:.40})")


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
                f"{argument} names {name!r}, which the pipeline does not have{close_hint(name, known)} (known: {known_names})"
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


OPTIONS, GROUPS = collect(DeploymentConfig)
