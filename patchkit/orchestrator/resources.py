"""What one replica may use: the cores it is pinned to, its math-library threads, its GPUs."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = ["ReplicaResources", "assign", "available_cpus", "available_gpus", "one_more", "spread"]

# Math and tokenizer libraries read these once, at import: they are set before a component loads.
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "RAYON_NUM_THREADS",
)


@dataclass(frozen=True)
class ReplicaResources:
    """Pinned per replica by the backend that starts it.

    `cpus`: the cores it runs on (empty: wherever the OS puts it); `threads`: the thread count math
    libraries use; `gpus`: its `CUDA_VISIBLE_DEVICES` (None: inherited; empty: no GPU visible).
    """

    cpus: tuple[int, ...] = ()
    threads: int | None = None
    gpus: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1; got {self.threads}")

    def environment(self) -> dict[str, str]:
        """The variables a worker process starts with."""
        env: dict[str, str] = {}
        if self.threads is not None:
            env.update(dict.fromkeys(THREAD_VARIABLES, str(self.threads)))
        if self.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpus))
        return env

    def pin(self) -> None:
        """Called by the worker process on itself, before it loads the component."""
        if self.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, self.cpus)

    def describe(self) -> dict[str, object]:
        return {"cpus": list(self.cpus), "threads": self.threads, "gpus": None if self.gpus is None else list(self.gpus)}


def available_cpus() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def available_gpus() -> list[int]:
    """The NVIDIA GPUs this process may use: `CUDA_VISIBLE_DEVICES` when set, else what `nvidia-smi -L` lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:  # the ids a child is given must be the ones this process sees
        return [int(d) for d in visible.split(",") if d.strip().isdigit()]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=True).stdout  # noqa: S603, S607
    except (OSError, subprocess.SubprocessError):
        return []
    return [i for i, line in enumerate(line for line in listed.splitlines() if line.startswith("GPU "))]


def assign(
    replicas: Sequence[tuple[str, int]], cpus: list[int] | None = None, gpus: list[int] | None = None
) -> list[ReplicaResources]:
    """Resources for replicas that each take `units` of a resource type ("cpu" or "gpu"), as a plan says.

    CPU replicas get disjoint cores, `units` each, while the machine has enough; past that (a
    declared pool larger than the machine) they float with `units` threads. GPU replicas get one
    real GPU each, in turn; where the machine has none (a declared, virtual GPU) they see no GPU.
    """
    cores = cpus if cpus is not None else available_cpus()
    devices = gpus if gpus is not None else available_gpus()
    pinned = sum(units for kind, units in replicas if kind == "cpu") <= len(cores)
    next_core, next_gpu, out = 0, 0, []
    for kind, units in replicas:
        if kind == "gpu":
            visible = (devices[next_gpu % len(devices)],) if devices else ()
            next_gpu += 1
            out.append(ReplicaResources(threads=1, gpus=visible))
        elif pinned:
            out.append(ReplicaResources(cpus=tuple(cores[next_core : next_core + units]), threads=units, gpus=()))
            next_core += units
        else:
            out.append(ReplicaResources(threads=units, gpus=()))
    return out


def one_more(kind: str, units: int, held_gpus: Collection[int], gpus: list[int] | None = None) -> ReplicaResources:
    """Resources for a replica added to a running deployment that a plan placed (the autoscaler's).

    The cores `assign` pinned stay with their replicas, so a CPU replica floats, with `units`
    threads. A GPU replica gets a GPU that no replica holds (`held_gpus`); where every one is held,
    or the machine has none, it sees no GPU (a virtual one, as `assign` places them).
    """
    if kind != "gpu":
        return ReplicaResources(threads=units, gpus=())
    free = [d for d in (gpus if gpus is not None else available_gpus()) if d not in held_gpus]
    return ReplicaResources(threads=1, gpus=tuple(free[:1]))


def spread(replicas: int, cpus: list[int] | None = None) -> list[ReplicaResources]:
    """Resources for `replicas` CPU replicas sharing this machine's cores.

    Each replica gets an equal share of math-library threads. Replicas are pinned to disjoint cores
    only when there are at least as many cores as replicas; otherwise they float, so the OS can
    balance more replicas than cores.
    """
    cores = cpus if cpus is not None else available_cpus()
    share = max(1, len(cores) // max(1, replicas))
    if replicas <= len(cores):
        return [ReplicaResources(cpus=tuple(cores[i * share : (i + 1) * share]), threads=share) for i in range(replicas)]
    return [ReplicaResources(threads=1) for _ in range(replicas)]
