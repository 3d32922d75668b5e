"""The sizes an unplanned deployment takes from the machine: what the planner would choose, without profiling.

`deploy(pipeline)` with no plan, no `replicas=` and no `batch_size=` used to run one replica of every
component, the cores split evenly between them: on two cores an LLM engine got one thread while a
retriever, idle most of the time, held the other. An engine that batches by itself and scales with
threads (a `max_concurrency` method with a cost model, `profile_call`: `LlamaCppGenerator`) gets
instead one replica holding its share of the cores, a thread on each, lending a share of its last
core to the light components (a retriever, a grader), which run on those shares. One replica, not
one single-thread replica per core: a lone request then computes on every core (two cores evaluate
its prompt and decode its tokens faster than one), and many requests batch in the one engine, whose
step budget keeps their tokens flowing while prompts are read; replicas of one thread each left a
lone request half of a two-core machine. `machine_plan` makes that layout from the core count alone,
so a user who has not planned yet does not pay for deploying; `patchkit.plan()` measures instead.

It applies where the layout is known to be right: CPU replicas on a machine with no GPU, at least one
such engine and no more engines than cores. Elsewhere (or with replicas, batch sizes or autoscaling
bounds given) the deployment keeps one replica of each component, the cores shared evenly.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from patchkit.core import Component, make_methods
from patchkit.orchestrator.resources import LENT_SIZES, SHARES_PER_CORE, available_cpus, available_gpus, valid_cpu_units
from patchkit.scheduler.offline.plan import ComponentPlan, Plan

__all__ = ["machine_plan", "scales_with_threads", "unplanned_plan"]

logger = logging.getLogger(__name__)

MACHINE_SOLVER = "machine"  # the Plan's `solver`: made from the cores, not from profiles


def scales_with_threads(component: Component) -> bool:
    """Whether `component` is an engine batching its calls itself whose speed the planner models by
    threads: a `max_concurrency` method and a `profile_call` (the planner's cost-model engines)."""
    if not callable(getattr(component, "profile_call", None)):
        return False
    return any(method.max_concurrency is not None for method in make_methods(type(component)).values())


def machine_plan(components: Mapping[str, Component], cores: int) -> Plan | None:
    """Replicas and threads for `cores` CPU cores, as the planner would choose them, or None where it has no rule.

    Every engine (`scales_with_threads`) gets one replica of `cores // engines` threads, a core each,
    lending the smallest share of its last core that holds the light components; every other
    component one replica of one share (1/SHARES_PER_CORE of a core). Batch sizes are left to the
    components' own declarations (the caller keeps them), so `batch_size` here is the engines' bound.

    Args:
        components: the deployment's components, by deployed name.
        cores: the cores the deployment may use.

    Returns:
        The plan (`solver` "machine", no throughput predicted), or None: no engine, more engines than
        cores, or more light components than the engines' replicas can lend shares to.
    """
    engines = [name for name, component in components.items() if scales_with_threads(component)]
    light = [name for name in components if name not in engines]
    if not engines or len(engines) > cores:
        return None
    per_engine = cores // len(engines)
    lent = next((size for size in LENT_SIZES if size * len(engines) >= len(light)
                 and valid_cpu_units(per_engine * SHARES_PER_CORE - size, per_engine)), None) if light else 0
    if lent is None:
        return None
    parts: dict[str, ComponentPlan] = {}
    for name, component in components.items():
        limit = max((component.batch_limit(method) for method in make_methods(type(component))), default=1)
        if name in engines:
            parts[name] = ComponentPlan("cpu", 1, limit, units=per_engine * SHARES_PER_CORE - lent, threads=per_engine,
                                        default_batch_size=limit)
        else:
            parts[name] = ComponentPlan("cpu", 1, limit, units=1, threads=1, default_batch_size=limit)
    return Plan(parts, throughput=0.0, bottleneck=engines[0], solver=MACHINE_SOLVER, capacity={"cpu": cores})


def unplanned_plan(components: Mapping[str, Component], options: Mapping[str, Any], cores: int | None = None) -> Plan | None:
    """The machine's layout for a deployment given no plan, replicas or batch sizes, or None to keep one replica each.

    Called by `DeploymentConfig.resolve`. Only the local backend on a machine with no GPU takes it (Ray
    places replicas across a cluster, the inprocess backend runs threads of one process), and only
    without autoscaling bounds (`min_replicas`, `max_replicas`), which the user sized themselves.

    Args:
        components: the deployment's components, by deployed name.
        options: deploy()'s flat options (`backend`, `min_replicas`, `max_replicas`).
        cores: the cores to plan for (default: those this process may run on).
    """
    if options.get("backend", "local") != "local" or any(options.get(k) is not None for k in ("min_replicas", "max_replicas")):
        return None
    cores = len(available_cpus()) if cores is None else cores
    found = machine_plan(components, cores)
    if found is None or available_gpus():
        return None
    logger.info("no plan given: %s, from the %d cores here (patchkit.plan() measures instead)", ", ".join(
        f"{name} x {part.replicas} ({part.threads} thread{'s' * (part.threads > 1)})" for name, part in found.components.items()),
        cores)
    return found
