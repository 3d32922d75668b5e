"""What one replica may use: the cores it is pinned to, its math-library threads, its GPUs.

CPU is counted in shares of a core, `SHARES_PER_CORE` a core. A replica of `units` shares is one of:

- a share replica (units in `SHARE_SIZES`, less than a core): one thread on a core it shares with
  other share replicas;
- a replica of whole cores (units a multiple of SHARES_PER_CORE): one thread on each of its cores;
- a replica of t cores that lends part of its last one (units t * SHARES_PER_CORE - l, l in
  `LENT_SIZES`, more units than any share replica takes): one thread on each, the l shares it lends
  taken by share replicas. An engine that scales with threads then gets every core of a small
  machine, or several 1-thread engines a core each, while light replicas (a retriever, a grader
  forwarding to the engine) take what they lend.

Share sizes and lent sizes are powers of two below SHARES_PER_CORE, itself a power of two. Placed largest
first, share replicas then always fit when, for every share size s, the shares of those of size s
or more fit in the rooms of s shares or more: free cores and lent parts (the MILP's rows).
In each room, what is left stays a multiple of the size being placed, so first fit wastes nothing,
and no core is given more shares than it has.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Collection, Sequence
from dataclasses import dataclass

__all__ = [
    "LENT_SIZES",
    "SHARES_PER_CORE",
    "SHARE_SIZES",
    "ReplicaResources",
    "assign",
    "available_cpus",
    "available_gpus",
    "cpu_threads",
    "lending_units",
    "lent_shares",
    "valid_cpu_units",
    "one_more",
    "spread",
]

SHARES_PER_CORE = 8  # CPU units per core: a light replica takes one, a replica of k whole cores k * 8
SHARE_SIZES = (1, 2, 4)  # shares a replica on a shared core may take: powers of two, so they pack
LENT_SIZES = (1, 2, 4)  # shares a replica of whole cores may lend of its last one to share replicas

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


def cpu_threads(units: int) -> int:
    """The threads of a CPU replica of `units` shares: one per core it holds (whole or lending part), one on a shared core."""
    return max(1, -(-units // SHARES_PER_CORE))


def lent_shares(units: int) -> int:
    """The shares a CPU replica of `units` lends of its last core (0 for whole cores and share replicas)."""
    return 0 if units in SHARE_SIZES else cpu_threads(units) * SHARES_PER_CORE - units


def lending_units(threads: int) -> list[int]:
    """The units a replica of `threads` whole cores may take lending part of its last one, most first."""
    whole = threads * SHARES_PER_CORE
    return [whole - lent for lent in LENT_SIZES if whole - lent > max(SHARE_SIZES)]


def valid_cpu_units(units: int, threads: int) -> bool:
    """Whether a CPU replica of `threads` threads may take `units` shares (see the module's docstring)."""
    if threads == 1 and units in SHARE_SIZES:
        return True
    return units == threads * SHARES_PER_CORE or units in lending_units(threads)


def assign(
    replicas: Sequence[tuple[str, int]], cpus: list[int] | None = None, gpus: list[int] | None = None
) -> list[ReplicaResources]:
    """Resources for replicas that each take `units` of a resource type ("cpu" or "gpu"), as a plan says.

    Called by the front-end for a planned deployment. CPU units are shares (`SHARES_PER_CORE` a core):
    replicas of several cores get disjoint cores, as many as their threads; share replicas are packed
    onto the cores left and the parts lent, each pinned to one core with one thread, never more
    shares on a core than it has.
    When they do not all fit the machine (a declared pool larger than it), CPU replicas float with
    their threads. GPU replicas get one real GPU each, in turn; where the machine has none (a
    declared, virtual GPU) they see no GPU.
    """
    cores = cpus if cpus is not None else available_cpus()
    devices = gpus if gpus is not None else available_gpus()
    placed = iter(_place_cpu([units for kind, units in replicas if kind != "gpu"], cores) or [])
    next_gpu, out = 0, []
    for kind, units in replicas:
        if kind == "gpu":
            visible = (devices[next_gpu % len(devices)],) if devices else ()
            next_gpu += 1
            out.append(ReplicaResources(threads=1, gpus=visible))
        else:
            out.append(ReplicaResources(cpus=next(placed, ()), threads=cpu_threads(units), gpus=()))
    return out


def _place_cpu(units: Sequence[int], cores: Sequence[int]) -> list[tuple[int, ...]] | None:
    """The cores of each CPU replica, in order; None when they do not fit on `cores`.

    Replicas of whole cores first, each on cores of its own (what the last one lends left to share
    replicas); then share replicas, largest first, each on the first core with shares enough left
    (first fit decreasing: exact for sizes in powers of two, see the module's docstring).
    """
    placed: list[tuple[int, ...]] = [()] * len(units)
    free, left = list(cores), dict[int, int]()
    for i, u in enumerate(units):
        if u > max(SHARE_SIZES):
            need = cpu_threads(u)
            if need > len(free):
                return None
            placed[i], free = tuple(free[:need]), free[need:]
            if lent := lent_shares(u):
                left[placed[i][-1]] = lent
    left.update(dict.fromkeys(free, SHARES_PER_CORE))
    for i in sorted((i for i, u in enumerate(units) if u <= max(SHARE_SIZES)), key=lambda i: -units[i]):
        core = next((c for c, shares in left.items() if shares >= units[i]), None)
        if core is None:
            return None
        left[core] -= units[i]
        placed[i] = (core,)
    return placed


def one_more(kind: str, units: int, held_gpus: Collection[int], gpus: list[int] | None = None) -> ReplicaResources:
    """Resources for a replica added to a running deployment that a plan placed (the autoscaler's).

    The cores `assign` pinned stay with their replicas, so a CPU replica floats, with the threads
    its `units` shares give it. A GPU replica gets a GPU that no replica holds (`held_gpus`); where
    every one is held, or the machine has none, it sees no GPU (a virtual one, as `assign` places them).
    """
    if kind != "gpu":
        return ReplicaResources(threads=cpu_threads(units), gpus=())
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
