"""deploy()'s options in groups, as vLLM's VllmConfig holds a ModelConfig, a CacheConfig, a SchedulerConfig.

Each group is a frozen dataclass, checked when built; each field is an `option()` whose metadata says
its help, bounds and choices (options.py). A reader asks `config.server.port`, `config.slo.slo_ms`,
`config.ray.address`; users keep passing flat names (`deploy(port=...)`, `ray_address: ...` in a file).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from patchkit import envs
from patchkit.config.options import OptionGroup, check_counts, check_names, check_priorities, check_targets, option
from patchkit.errors import ConfigError
from patchkit.orchestrator.ray_options import ACTOR_OPTIONS, ACTOR_RESOURCES, RayOptions

__all__ = [
    "BACKENDS", "ESTIMATORS", "LOG_LEVELS", "STEPS", "AutoscalingConfig", "ChatConfig", "LimitsConfig", "LivenessConfig",
    "RayConfig", "ServerConfig", "SloConfig",
]

BACKENDS = ("local", "inprocess", "ray")
ESTIMATORS = ("average", "xgboost")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
STEPS = ("off", "timings", "previews")  # the server's `steps` option: what step events callers may see


@dataclass(frozen=True)
class ServerConfig(OptionGroup):
    """The HTTP server: where it listens, what a request must bring, what replies and logs show."""

    host: str = option("127.0.0.1", help="the address the HTTP server listens on",
                       nonempty="an address to listen on, such as '127.0.0.1' or '0.0.0.0'", flag=True)
    port: int = option(0, help="the port it listens on (0: any free port)", ge=0, le=65535, flag=True)
    read_timeout_s: float = option(30.0, help="a request's headers and body must arrive within this, else 408",
                                   gt=0, described=True)
    auth_token: str | None = option(None, help="a bearer token for every route but /healthz, /readyz and the "
                                    "dashboard's page (default: PATCHKIT_AUTH_TOKEN)",
                                    nonempty="a non-empty string (the bearer token clients send)", secret=True)
    optional_inputs: tuple[str, ...] = option((), help="inputs a request may leave out (they keep their captured value)",
                                              check=check_names, described=True)
    debug: bool = option(False, help="error replies carry tracebacks", described=True)
    steps: str = option("timings", help="what step events a client that asks for them gets: 'off' (none: asking is a 400), "
                        "'timings' (each call's start and end, where and how long it ran) or 'previews' (and a preview of "
                        "each call's result, never of a component marked sensitive)", choices=STEPS, described=True,
                        flag=True)
    step_preview_chars: int = option(200, help="with steps='previews', the most characters of text a preview shows "
                                     "across its strings", gt=0, described=True)
    # None: as the deploying process's `patchkit` logger (its effective level), which `resolve` reads.
    log_level: str | None = option(None, help="what the front-end and the workers log: debug, info, warning, error or critical",
                                   choices=tuple(level.lower() for level in LOG_LEVELS), any_case=True, described=True,
                                   flag=True)

    def __post_init__(self) -> None:
        if self.auth_token is None:  # the environment's, checked as a given one is
            object.__setattr__(self, "auth_token", envs.auth_token())
        super().__post_init__()

    def check(self) -> None:
        """Make `optional_inputs` a tuple and `log_level` upper case."""
        object.__setattr__(self, "optional_inputs", tuple(self.optional_inputs))
        if self.log_level is not None:
            object.__setattr__(self, "log_level", self.log_level.upper())


@dataclass(frozen=True)
class LimitsConfig(OptionGroup):
    """What may be in flight at once, and how calls are batched and requests admitted."""

    max_body_bytes: int = option(1 << 20, help="the largest request body (decoded)", gt=0, described=True)
    max_inflight_bytes: int = option(256 << 20, help="request body bytes in flight; beyond it, 503", gt=0, described=True)
    max_inflight_requests: int = option(4096, help="requests in flight; beyond it, 503 with Retry-After", gt=0,
                                        described=True)
    max_inflight_batches: int = option(2, help="batches per replica at once: one running, one on the wire", gt=0,
                                       described=True)
    batch_wait_ms: float = option(0.0, help="a partial batch leaves once its oldest call waited this long", ge=0,
                                  described=True, flag=True)
    pipelining: bool = option(True, help="false: requests run in waves, each waiting for the one before", described=True)
    parallel_calls: bool = option(True, help="a request's independent calls of methods declared "
                                  "@make(read_only=True) overlap, each waited for where its result is first needed; "
                                  "every other call keeps its place; false: one call at a time, as plain Python",
                                  described=True)

    def check(self) -> None:
        """Refuse a `max_inflight_bytes` below `max_body_bytes`: a body of the largest size could never be admitted."""
        if self.max_inflight_bytes < self.max_body_bytes:
            raise ConfigError(f"max_inflight_bytes ({self.max_inflight_bytes}) must be >= max_body_bytes "
                              f"({self.max_body_bytes}): a body of the largest size could never be admitted")


@dataclass(frozen=True)
class LivenessConfig(OptionGroup):
    """How long requests and calls may take, how replicas are checked, how long stopping waits, and fail-fast.

    `fail_fast`: whether a pipeline whose component cannot start at deploy stops the others.
    """

    request_timeout_s: float = option(300.0, help="a request still running after this gets 504", gt=0, described=True)
    call_timeout_s: float = option(300.0, help="a batch running longer recycles its replica (unless its method says "
                                   "otherwise)", gt=0, described=True)
    # A batch whose every call belongs to a request that has ended, running on past the latest of their deadlines,
    # serves nobody: its replica gets nothing more and is replaced at once (a surge), and it is stopped once that batch
    # is back or has run this much longer. Long enough for a healthy call to come back once told its request ended (a
    # stream=True method stops at its next chunk), so that it is not killed mid-call for nothing.
    abandoned_grace_s: float = option(5.0, help="a replica replaced for running a batch that serves only ended requests "
                                      "is stopped once the batch is back, or this long after its last deadline", gt=0,
                                      described=True)
    max_retries: int = option(2, help="times a call is sent again after its replica died (unless its method says otherwise)",
                              ge=0, described=True)
    # As Ray Serve's: every period, each replica must answer within the timeout; after `health_check_failures`
    # failures in a row it is recycled.
    health_check_period_s: float = option(10.0, help="how often every replica is health-checked", gt=0, described=True)
    health_check_timeout_s: float = option(30.0, help="how long a health check may take", gt=0, described=True)
    health_check_failures: int = option(3, help="failed checks in a row that recycle a replica", gt=0, described=True)
    drain_timeout_s: float = option(30.0, help="how long stopping waits for requests in flight", ge=0, described=True)
    # Off, as Ray Serve keeps each application's status apart: a pipeline whose component cannot start at deploy is
    # failed, with its reason, while the others serve; deploy() and `patchkit serve` fail only when none can serve.
    fail_fast: bool = option(False, help="deploy() and patchkit serve fail when any pipeline's component cannot start "
                             "(off: that pipeline is failed, with its reason, and the others serve)", described=True,
                             flag=True)


@dataclass(frozen=True)
class SloConfig(OptionGroup):
    """The latency target and the policies active for requests with one (the request's slo_ms, else this)."""

    slo_ms: float | dict[str, float] | None = option(
        None, help="the latency target of every request that brings none: one number of ms, or by pipeline name",
        check=check_targets, described=True, flag=True)
    priority: int | dict[str, int] = option(
        0, help="of a pipeline's calls in the queues of the components it shares: higher leaves first; one integer, or by "
        "pipeline name", check=check_priorities, described=True)
    prioritize: bool = option(True, help="calls of requests at risk of missing their SLO jump their queues, least slack "
                              "first", described=True)
    pause_admission: bool = option(False, help="while a request is at risk, new ones wait in a bounded queue", described=True)
    admission_queue_limit: int = option(1024, help="that queue's length; beyond it, 503 with Retry-After", gt=0,
                                        described=True)
    estimator: str = option("average", help="of a request's remaining time: 'average' (per graph position) or 'xgboost'",
                            choices=ESTIMATORS, described=True)
    prefetch: bool = option(True, help="send a retriever's prefetch the input of the call its query comes from, as that "
                            "call starts", described=True)

    def check(self) -> None:
        """Keep `slo_ms` and `priority` by pipeline name as plain dicts."""
        for name in ("slo_ms", "priority"):
            if isinstance(value := getattr(self, name), Mapping):  # a plain dict, so that describe() stays JSON-able
                object.__setattr__(self, name, dict(value))

    def slo_of(self, pipeline: str) -> float | None:
        """The latency target of pipeline `pipeline`'s requests that bring none."""
        return self.slo_ms.get(pipeline) if isinstance(self.slo_ms, dict) else self.slo_ms

    def priority_of(self, pipeline: str) -> int:
        """The priority of pipeline `pipeline`'s calls in the queues of the components it shares."""
        return self.priority.get(pipeline, 0) if isinstance(self.priority, dict) else self.priority


@dataclass(frozen=True)
class AutoscalingConfig(OptionGroup):
    """Replicas added to the bottleneck while requests stay at risk, idle ones removed, within bounds."""

    autoscale: bool = option(True, help="add replicas to the bottleneck while requests stay at risk; remove idle ones",
                             described=True)
    autoscale_interval_s: float = option(1.0, help="how often the autoscaler looks", gt=0, described=True)
    scale_up_after_s: float = option(2.0, help="requests at risk this long (and this long after a scale-up): one more "
                                     "replica", ge=0, described=True)
    scale_down_after_s: float = option(30.0, help="a component idle this long loses a replica", ge=0, described=True)
    min_replicas: int | dict[str, int] | None = option(
        None, help="the fewest replicas autoscaling leaves: one number, or by component (default: as deployed)",
        check=check_counts, described=True)
    max_replicas: int | dict[str, int] | None = option(
        None, help="the most replicas autoscaling gives: one number, or by component (default: as resources allow)",
        check=check_counts, described=True)

    def check(self) -> None:
        """Keep the bounds by name as plain dicts; refuse a `max_replicas` below `min_replicas`."""
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            if isinstance(value, Mapping):  # a plain dict, so that describe() stays JSON-able
                object.__setattr__(self, name, dict(value))
        low, high = self.min_replicas, self.max_replicas
        if isinstance(low, int) and isinstance(high, int) and high < low:  # by name, checked per component
            raise ConfigError(f"max_replicas ({high}) must be >= min_replicas ({low})")


def _check_actor_options(name: str, value: object) -> None:
    RayOptions(actor_options=value)  # type: ignore[arg-type]  # its rules: what Ray takes  # type: ignore[arg-type]


def _requested_resources(actor_options: Mapping[str, Mapping[str, Any]] | None) -> dict[str, Any] | None:
    """What `GET /v1/plan` shows of ray_actor_options: the resources each component asks for, never its environment."""
    if actor_options is None:
        return None
    return {name: {k: v for k, v in given.items() if k in ACTOR_RESOURCES} for name, given in actor_options.items()}


@dataclass(frozen=True)
class RayConfig(OptionGroup):
    """The ray backend's (orchestrator/ray_options.py says each in full).

    The cluster, Ray's restarts of a dead actor, how long a replica may wait for resources, actor options by component, and TLS to
    the workers.
    """

    backend: ClassVar[str | None] = "ray"

    address: str | None = option(None, name="ray_address", help="the Ray cluster to join (default: the one this process "
                                 "is connected to, else RAY_ADDRESS, else a local one)",
                                 nonempty="a cluster address such as 'auto' or 'HOST:6379'")
    max_restarts: int = option(3, name="ray_max_restarts", help="Ray's restarts of a dead actor (-1: without end)", ge=-1,
                               described=True)
    placement_timeout_s: float = option(60.0, name="ray_placement_timeout_s", gt=0, described=True,
                                        help="how long a replica may wait for cluster resources")
    actor_options: dict[str, dict[str, Any]] | None = option(
        None, name="ray_actor_options", check=_check_actor_options, described=_requested_resources,
        help=f"Ray actor options by component ({', '.join(ACTOR_OPTIONS)})")
    tls: bool = option(True, help="TLS between the front-end and Ray workers (false: plaintext)", described=True)
    tls_cert: str | None = option(None, help="the workers' certificate file (default: one made for the deployment)")
    tls_key: str | None = option(None, help="its private key file")
    tls_ca: str | None = option(None, help="the CA file that signed it")
    tls_server_name: str | None = option(None, help="the name the certificate is checked against")

    def check(self) -> None:
        """The rules between the TLS options (a cert with its key, no file with `tls=False`, files that exist)."""
        self.options()  # the rules between them: tls_cert with tls_key, no file with tls=False, files that exist
        if self.actor_options is not None:
            object.__setattr__(self, "actor_options", {k: dict(v) for k, v in self.actor_options.items()})

    def options(self) -> RayOptions:
        """As the orchestrator's `RayOptions`, which the ray backend takes (the orchestrator never reads a config)."""
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        return RayOptions(**{**given, "actor_options": self.actor_options or {}})


@dataclass(frozen=True)
class ChatConfig(OptionGroup):
    """The OpenAI chat API (server/chat.py)."""

    name: str = option("patchkit", help="the model name /v1/models lists and chat completions answer as",
                       nonempty="a non-empty string", described=True)
    input: str | None = option(None, name="chat_input", nonempty="a non-empty string", described=True,
                               help="the pipeline input the chat API's last user message fills (needed with several inputs)")
    output: str | None = option(None, name="chat_output", nonempty="a non-empty string", described=True,
                                help="the field of a dict output the chat API answers with")
    drop_params: tuple[str, ...] = option((), name="chat_drop_params", check=check_names, described=True,
                                          help="chat request fields accepted and ignored where neither a pipeline input "
                                          "nor honoured by the answering call (each logged once), as LiteLLM's drop_params")

    def check(self) -> None:
        """Make `drop_params` a tuple."""
        object.__setattr__(self, "drop_params", tuple(self.drop_params))
