"""What one replica may use: the cores it is pinned to, its math-library threads, its GPUs."""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["ReplicaResources", "available_cpus", "spread"]

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
