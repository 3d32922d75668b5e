"""The `ray` backend: every replica is a Ray actor, placed by Ray's scheduler across a cluster's nodes.

Each actor asks Ray for the replica's resources (CPUs, whole or fractional GPUs, memory, custom
resources), hosts the local backend's gRPC worker (`ray_actor.py`) and reports its address; the
front-end then talks to it over gRPC with the deployment's secret, as to a local worker, but over
TLS (the user's certificate, else one made for the deployment; `tls=False` opts out), since the
actor listens beyond loopback. Ray is only the placement and restart layer: no batch travels through
Ray's object store.

Failures: an actor that dies is restarted by Ray in place (`max_restarts` times), after the
supervisor has taken it out of dispatch; past that a new actor replaces it. A replica Ray cannot
place within `placement_timeout_s` fails to start with an error naming what is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import threading
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from patchkit import envs
from patchkit.errors import ConfigError, PatchkitError, WorkerDiedError, error_from_json
from patchkit.orchestrator.backend import Backend, Replica, ReplicaSpec
from patchkit.orchestrator.ray_actor import KEEPALIVE_CHANNEL_OPTIONS, ReplicaActor
from patchkit.orchestrator.ray_options import RayOptions
from patchkit.orchestrator.resources import SHARES_PER_CORE, ReplicaResources, available_cpus, available_gpus, cpu_threads
from patchkit.orchestrator.rpc import GrpcChannel
from patchkit.orchestrator.worker import WorkerBootstrap

__all__ = ["RayBackend", "cluster_resources"]

logger = logging.getLogger(__name__)

GPU_SHARE_DECIMALS = 4  # Ray takes fractional GPUs to four decimals
CONNECT_TIMEOUT_S = 10.0


@dataclass
class Actor:
    """A replica's actor and how many times Ray has restarted it (as this backend saw it die)."""

    handle: Any
    restarts: int = 0


class RayBackend(Backend):
    name = "ray"

    def __init__(self, secret: str, options: RayOptions, *, gpu_units: int = 0) -> None:
        """`gpu_units`: GPU units the plan gives all replicas together; above the cluster's GPUs, they share them."""
        if not secret:
            raise ValueError("the ray backend needs the deployment's secret: its workers listen beyond loopback")
        self._secret = secret
        self._options = options
        self._tls = options.tls_files()  # TLS by default: the workers listen beyond loopback
        self._gpu_units = gpu_units
        self._actors: dict[Replica, Actor] = {}
        self._parked: dict[str, list[Actor]] = defaultdict(list)  # by component: dead actors Ray is restarting
        self._remote: Any = None  # ray.remote(ReplicaActor), once connected
        self._capacity: dict[str, int] = {}
        self._started_ray = False

    # -- the cluster ----------------------------------------------------------------------------
    def _connect(self) -> None:
        """Join the cluster once, on the loop's thread: Ray installs signal handlers only from the main thread,
        and nothing is served before the first replica starts."""
        if self._remote is not None:
            return
        import ray

        if not ray.is_initialized():
            where = self._options.address or os.environ.get("RAY_ADDRESS") or "a new local instance"
            _check_reachable(self._options.address or os.environ.get("RAY_ADDRESS"))
            try:
                with _own_signal_handlers():
                    ray.init(address=self._options.address, configure_logging=False)
            except Exception as exc:
                raise PatchkitError(
                    f"cannot join the Ray cluster ({where}): {type(exc).__name__}: {exc}. Check ray_address, and that "
                    "`ray status` on the head node lists the cluster"
                ) from exc
            self._started_ray = True
        self._capacity = _capacity(ray.nodes())
        self._remote = ray.remote(ReplicaActor)
        logger.info("ray backend: cluster of %d nodes, %s", len(_alive(ray.nodes())), self._capacity)

    def place(self, placed: Sequence[tuple[str, int]], planned: bool) -> list[ReplicaResources]:
        """Ray places the replicas and sets their GPUs; only their thread counts are ours."""
        return [self.place_one(resource, units, planned, ()) for resource, units in placed]

    def place_one(self, resource: str, units: int, planned: bool, running: Sequence[Replica]) -> ReplicaResources:
        return ReplicaResources(threads=cpu_threads(units) if resource == "cpu" else 1)

    def room(self, specs: Sequence[ReplicaSpec]) -> bool:
        """Whether what the cluster has free now (`ray.available_resources()`) holds what the actors of `specs` ask for."""
        import ray

        self._connect()
        wanted: dict[str, float] = defaultdict(float)
        for spec in specs:
            for key, amount in _wanted(self.actor_options(spec)).items():
                wanted[key] += amount
        free = ray.available_resources()
        short = {key: free.get(key, 0.0) for key, amount in wanted.items() if free.get(key, 0.0) + 1e-9 < amount}
        if short:
            logger.info("the Ray cluster has no room for %d more replicas: they ask for %s; free: %s", len(specs),
                        _amounts(wanted), _amounts(short))
        return not short

    def capacity(self) -> dict[str, int] | None:
        return dict(self._capacity) if self._capacity else None

    # -- replicas -------------------------------------------------------------------------------
    async def start(self, spec: ReplicaSpec, replica_id: str) -> Replica:
        self._connect()
        adopted = await self._adopt(spec, replica_id)
        if adopted is None:
            actor = Actor(await asyncio.to_thread(self._create, spec))  # pickles the component: off the loop
            try:
                report = await self._serve(actor, spec, replica_id)
            except BaseException:
                await self._kill(actor)
                raise
        else:
            actor, report = adopted
        address = report["address"]
        credentials, options = self._tls.channel_credentials() if self._tls is not None else (None, [])
        channel = GrpcChannel(address, self._secret, credentials, [*options, *KEEPALIVE_CHANNEL_OPTIONS])
        replica = Replica(replica_id, spec, channel, pid=report["pid"], address=address, handle=actor)
        self._actors[replica] = actor
        try:
            await channel.open()
        except Exception as exc:
            await self.stop(replica)
            raise WorkerDiedError(f"replica {replica_id} serves at {address}, but the front-end cannot reach it: {exc}") from exc
        return replica

    async def _adopt(self, spec: ReplicaSpec, replica_id: str) -> tuple[Actor, dict[str, Any]] | None:
        """A dead actor of this component that Ray is restarting, once it serves again; None when there is none
        (or Ray could not bring it back: it is killed, and a new actor is started instead)."""
        while self._parked[spec.component]:
            actor = self._parked[spec.component].pop()
            actor.restarts += 1
            try:
                report = await self._serve(actor, spec, replica_id)
            except Exception as exc:
                logger.warning("Ray could not restart the actor of %s (%s); starting a new one", replica_id, exc)
                await self._kill(actor)
                continue
            logger.warning("replica %s is back: Ray restarted its actor in place (restart %d of %s)", replica_id,
                           actor.restarts, "unlimited" if self._options.max_restarts == -1 else self._options.max_restarts)
            return actor, report
        return None

    def _create(self, spec: ReplicaSpec) -> Any:
        tls = (self._tls.certificate, self._tls.key) if self._tls is not None else None
        boot = WorkerBootstrap.of(spec, self._secret, tls=tls)
        options = self.actor_options(spec)
        # Its methods are idempotent: a call that meets the actor restarting waits for it, rather than failing.
        retries = -1 if self._options.max_restarts else 0
        return self._remote.options(max_restarts=self._options.max_restarts, max_task_retries=retries, **options).remote(boot)

    def actor_options(self, spec: ReplicaSpec) -> dict[str, Any]:
        """What a replica's actor asks Ray for: the plan's units of its device, then the user's `ray_actor_options`.

        A CPU replica takes its `units` shares of a core as CPUs (SHARES_PER_CORE shares a CPU). A GPU
        replica takes `units` GPUs and no CPU of the plan's; where the plan gives more GPU units than
        the cluster has, replicas share each GPU in equal fractions (so that they pack: 1/2 each for
        3 on 2 GPUs). A cluster with no GPU runs GPU
        replicas on a virtual one, as the local backend does.
        """
        device = spec.device or next((d for d in spec.instance.devices if self._capacity.get(d)), "cpu")
        options: dict[str, Any]
        if device != "gpu":
            options = {"num_cpus": spec.units / SHARES_PER_CORE, "num_gpus": 0}
        else:
            options = {"num_cpus": 0, "num_gpus": self._gpus_per_replica(spec.units)}
        env = {k: v for k, v in spec.resources.environment().items() if k != "CUDA_VISIBLE_DEVICES"}
        user = dict(self._options.actor_options.get(spec.component, {}))
        runtime_env = dict(user.pop("runtime_env", None) or {})
        runtime_env["env_vars"] = {**env, **runtime_env.get("env_vars", {})}
        options.update(user, runtime_env=runtime_env)
        return options

    def _gpus_per_replica(self, units: int) -> float:
        gpus = self._capacity.get("gpu", 0)
        if gpus == 0:
            return 0
        if self._gpu_units <= gpus:
            return units
        per_gpu = math.ceil(self._gpu_units / gpus)  # replicas that share one GPU
        share = math.floor(units / per_gpu * 10**GPU_SHARE_DECIMALS) / 10**GPU_SHARE_DECIMALS
        return float(math.floor(share)) if share >= 1 else share

    async def _serve(self, actor: Actor, spec: ReplicaSpec, replica_id: str) -> dict[str, Any]:
        """Wait until Ray has placed the actor (bounded), then until it serves; its report."""
        import ray

        timeout_s = self._options.placement_timeout_s
        unfit = _unfit(self.actor_options(spec), ray.nodes())
        if unfit:
            logger.warning("replica %s cannot be placed on any node of the Ray cluster as it is (%s); it waits %g s "
                           "(ray_placement_timeout_s) for a node that can hold it", replica_id, unfit, timeout_s)
        try:
            await asyncio.wait_for(_result(actor.handle.node.remote()), timeout_s)
        except TimeoutError:
            raise WorkerDiedError(self._unplaced(spec, replica_id)) from None
        except Exception as exc:
            raise WorkerDiedError(f"the actor of replica {replica_id} died before it started: {exc}") from None
        try:
            report: dict[str, Any] = await asyncio.wait_for(_result(actor.handle.start.remote()), envs.worker_start_timeout_s())
        except TimeoutError:
            raise WorkerDiedError(f"replica {replica_id} did not start within {envs.worker_start_timeout_s():g} s "
                                  "(PATCHKIT_WORKER_START_TIMEOUT_S)") from None
        except Exception as exc:
            raise WorkerDiedError(f"the actor of replica {replica_id} died while it started: {exc}") from None
        if "error" in report:
            raise error_from_json(report["error"])
        return report

    def _unplaced(self, spec: ReplicaSpec, replica_id: str) -> str:
        import ray

        options = self.actor_options(spec)
        wanted = _wanted(options)
        unfit = _unfit(options, ray.nodes())
        if unfit:
            why = f"no node of the cluster has that much: {unfit}"
        else:
            free = ray.available_resources()
            short = {k: free.get(k, 0.0) for k, v in wanted.items() if free.get(k, 0.0) < v}
            why = (f"a node could hold it, but too little is free now (free in the cluster: {_amounts(short or free)}); "
                   "other replicas or Ray jobs hold the rest")
        return (f"replica {replica_id} could not be placed on the Ray cluster within {self._options.placement_timeout_s:g} s "
                f"(ray_placement_timeout_s): it asks for {_amounts(wanted)}; {why}. Add nodes with these resources, or "
                "ask for less (fewer replicas, ray_actor_options)")

    async def stop(self, replica: Replica) -> None:
        """Stop a replica's actor for good; a dead one that Ray may still restart is kept for `start` to adopt."""
        died = not replica.alive and replica.channel.lost_reason != "the channel was closed"
        await replica.channel.close()
        actor = self._actors.pop(replica, None)
        if actor is None:
            return
        restarts = self._options.max_restarts
        if died and (restarts == -1 or actor.restarts < restarts):
            self._parked[replica.component].append(actor)
        else:
            await self._kill(actor)

    async def _kill(self, actor: Actor) -> None:
        import ray

        try:
            await asyncio.to_thread(ray.kill, actor.handle, no_restart=True)
        except Exception as exc:  # gone already
            logger.debug("killing an actor: %s", exc)

    def replicas(self) -> list[Replica]:
        return list(self._actors)

    async def watch(self, replica: Replica) -> str:
        """Returns once the replica's stream breaks: its actor died (Ray restarts it) or it was stopped."""
        await replica.channel.lost.wait()
        return f"its Ray actor (pid {replica.pid} at {replica.address}) is gone: {replica.channel.lost_reason}"

    async def close(self) -> None:
        parked = [actor for actors in self._parked.values() for actor in actors]
        self._parked.clear()
        await asyncio.gather(*(self._kill(actor) for actor in parked))
        if self._started_ray:
            import ray

            await asyncio.to_thread(ray.shutdown)


def _check_reachable(address: str | None) -> None:
    """Fail fast on a HOST:PORT nobody listens on: Ray itself retries such an address for minutes."""
    if not address or address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"ray_address must be 'auto', 'HOST:PORT' or 'ray://HOST:PORT'; got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise PatchkitError(
            f"no Ray cluster answers at {address} ({exc}): start one with `ray start --head --port={port}` on {host}, "
            "or pass the address `ray start --head` printed"
        ) from None


@contextlib.contextmanager
def _own_signal_handlers() -> Iterator[None]:
    """Keep the front-end's SIGTERM and SIGINT handling (drain, then stop) over the exit Ray installs on connecting."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in kept.items():
            signal.signal(signum, handler)


async def _result(ref: Any) -> Any:
    """An ObjectRef's value, awaited on this loop."""
    return await asyncio.wrap_future(ref.future())


def _alive(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [node for node in nodes if node.get("Alive")]


def _capacity(nodes: list[dict[str, Any]]) -> dict[str, int]:
    """Whole CPUs and GPUs over the cluster's alive nodes."""
    alive = _alive(nodes)
    return {
        "cpu": int(sum(node["Resources"].get("CPU", 0) for node in alive)),
        "gpu": int(sum(node["Resources"].get("GPU", 0) for node in alive)),
    }


def _wanted(options: Mapping[str, Any]) -> dict[str, float]:
    """Ray's resource names and amounts for actor options."""
    wanted = {"CPU": float(options.get("num_cpus") or 0), "GPU": float(options.get("num_gpus") or 0)}
    if options.get("memory"):
        wanted["memory"] = float(options["memory"])
    wanted.update({k: float(v) for k, v in (options.get("resources") or {}).items()})
    return {k: v for k, v in wanted.items() if v > 0}


def _unfit(options: Mapping[str, Any], nodes: list[dict[str, Any]]) -> str:
    """'' when some alive node's total resources hold the request; else what the best node lacks."""
    wanted = _wanted(options)
    alive = _alive(nodes)
    if any(all(node["Resources"].get(k, 0.0) >= v for k, v in wanted.items()) for node in alive):
        return ""
    most = {k: max((node["Resources"].get(k, 0.0) for node in alive), default=0.0) for k in wanted}
    return ", ".join(f"{k} {_amount(k, v)} (the largest node has {_amount(k, most[k])})"
                     for k, v in wanted.items() if most[k] < v)


def _amount(key: str, value: float) -> str:
    if key in ("memory", "object_store_memory"):
        return f"{value / 2**30:.2f} GiB"
    return f"{value:g}"


def _amounts(values: Mapping[str, float]) -> str:
    return ", ".join(f"{k} {_amount(k, v)}" for k, v in sorted(values.items())) or "nothing"


def cluster_resources(address: str | None = None) -> dict[str, int]:
    """The Ray cluster's whole CPUs and GPUs, as `resources=` of `plan()` takes them.

    Connects to `address` (None: the cluster `RAY_ADDRESS` names, or the one this process is
    connected to) and disconnects again if it was not connected before. With neither, it is this
    machine's, which a local Ray instance started for a deployment would have.
    """
    import ray

    if ray.is_initialized():
        return _capacity(ray.nodes())
    if address is None and not os.environ.get("RAY_ADDRESS"):
        return {"cpu": len(available_cpus()), "gpu": len(available_gpus())}
    _check_reachable(address or os.environ.get("RAY_ADDRESS"))
    with _own_signal_handlers():
        ray.init(address=address, configure_logging=False, log_to_driver=False)
    try:
        return _capacity(ray.nodes())
    finally:
        ray.shutdown()
