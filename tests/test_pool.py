"""Resource pools (detected or declared) and placing a plan's replicas on cores and GPUs."""

from __future__ import annotations

import random
from collections import Counter

import pytest

import patchkit
from patchkit.orchestrator.resources import (
    LENT_SIZES,
    SHARE_SIZES,
    SHARES_PER_CORE,
    ReplicaResources,
    assign,
    available_gpus,
    cpu_threads,
)
from patchkit.scheduler.offline.pool import ResourcePool


def test_a_declared_pool_larger_than_the_machine_is_virtual() -> None:
    pool = ResourcePool.resolve({"cpu": 64, "gpu": 2})
    assert pool.capacity == {"cpu": 64, "gpu": 2}
    assert pool.virtual == {"cpu"} | ({"gpu"} if len(available_gpus()) < 2 else set())
    assert ResourcePool.parse("cpu=1,gpu=0").capacity == {"cpu": 1, "gpu": 0}
    assert ResourcePool.resolve({"gpu": 0}).capacity["cpu"] >= 1  # an omitted type is what the machine has


@pytest.mark.parametrize(
    ("resources", "message"),
    [({"tpu": 1}, "the resource types are cpu, gpu"), ({"cpu": -1}, "whole number of units"), ([("cpu", 1)], "a mapping")],
)
def test_a_bad_pool_names_the_fix(resources: object, message: str) -> None:
    with pytest.raises(patchkit.InputError, match=message):
        ResourcePool.resolve(resources)  # type: ignore[arg-type]
    with pytest.raises(patchkit.InputError, match="kind=units pairs"):
        ResourcePool.parse("cpu:4")


def test_cpu_replicas_get_disjoint_cores_while_there_are_enough() -> None:
    placed = assign([("cpu", 2 * SHARES_PER_CORE), ("cpu", SHARES_PER_CORE), ("gpu", 1)], cpus=[0, 1, 2, 3], gpus=[5])
    assert placed == [
        ReplicaResources(cpus=(0, 1), threads=2, gpus=()),
        ReplicaResources(cpus=(2,), threads=1, gpus=()),
        ReplicaResources(threads=1, gpus=(5,)),
    ]


def test_share_replicas_pack_onto_the_cores_whole_core_replicas_leave() -> None:
    # CRAG on 2 cores: the LLM holds a core; retriever, grader, rewriter and web share the other.
    replicas = [("cpu", 1), ("cpu", SHARES_PER_CORE), ("cpu", 1), ("cpu", 1), ("cpu", 1)]
    placed = assign(replicas, cpus=[0, 1], gpus=[])
    assert placed[1] == ReplicaResources(cpus=(0,), threads=1, gpus=())
    assert [r.cpus for r in placed[:1] + placed[2:]] == [(1,)] * 4 and {r.threads for r in placed} == {1}


def test_share_replicas_take_the_half_core_a_replica_of_two_lends() -> None:
    # CRAG on 2 cores, the LLM on both with 2 threads, lending half of core 1 to the four light ones
    replicas = [("cpu", 1), ("cpu", 2 * SHARES_PER_CORE - 4), ("cpu", 2), ("cpu", 1)]
    placed = assign(replicas, cpus=[0, 1], gpus=[])
    assert placed[1] == ReplicaResources(cpus=(0, 1), threads=2, gpus=())
    assert [r.cpus for r in placed[:1] + placed[2:]] == [(1,)] * 3
    # past the half lent, they would not fit: the replicas float
    assert assign([*replicas, ("cpu", 1)], cpus=[0, 1], gpus=[])[0].cpus == ()


def test_one_thread_replicas_lend_parts_of_their_cores() -> None:
    # two 1-thread engines on a core each, lending 2 and 1 shares: a 2-share replica fits only the 2 lent
    replicas = [("cpu", 1), ("cpu", SHARES_PER_CORE - 1), ("cpu", SHARES_PER_CORE - 2), ("cpu", 2)]
    placed = assign(replicas, cpus=[0, 1], gpus=[])
    assert [r.cpus for r in placed] == [(0,), (0,), (1,), (1,)] and {r.threads for r in placed} == {1}


def _fits(units: list[int], cores: int) -> bool:
    """The MILP's rule, counted here on its own: replicas of whole cores hold no more cores than there are,
    and for every share size s the share replicas of s or more fit the free cores and the lent parts of s
    or more."""
    held = [u for u in units if u not in SHARE_SIZES]
    free = cores - sum(cpu_threads(u) for u in held)
    lent = [cpu_threads(u) * SHARES_PER_CORE - u for u in held]
    shares = [u for u in units if u in SHARE_SIZES]
    return free >= 0 and all(
        sum(u for u in shares if u >= s) <= free * SHARES_PER_CORE + sum(part for part in lent if part >= s) for s in SHARE_SIZES
    )


@pytest.mark.parametrize("seed", range(60))
def test_no_core_is_given_more_shares_than_it_has(seed: int) -> None:
    """Any mix of replicas the MILP allows is placed: replicas of whole cores on cores of their own, a
    thread a core, all of each but the part the last one lends; share replicas one thread each on one
    core, on what is left. No core is given more than SHARES_PER_CORE shares."""
    rng = random.Random(seed)
    cores = list(range(rng.randint(1, 6)))
    whole = [t * SHARES_PER_CORE for t in (1, 2, 3)]
    lending = [w - lent for w in whole for lent in LENT_SIZES if w - lent > max(SHARE_SIZES)]
    units: list[int] = []
    for i in range(40):  # as the MILP allows, replicas of whole cores first: the lent parts are then small rooms
        u = rng.choice([*whole, *lending] if i < 10 else SHARE_SIZES)
        if _fits([*units, u], len(cores)):
            units.append(u)
    placed = assign([("cpu", u) for u in units], cpus=cores, gpus=[])
    given, held = Counter(), Counter()
    for u, r in zip(units, placed):
        assert r.threads == cpu_threads(u) == -(-u // SHARES_PER_CORE)
        if u in SHARE_SIZES:
            assert len(r.cpus) == 1
            given[r.cpus[0]] += u
            continue
        assert len(r.cpus) == r.threads  # a thread a core
        held.update(r.cpus)
        given.update(dict.fromkeys(r.cpus, SHARES_PER_CORE))
        given[r.cpus[-1]] -= r.threads * SHARES_PER_CORE - u
    assert all(n == 1 for n in held.values())
    assert all(n <= SHARES_PER_CORE for n in given.values())


def test_past_the_machine_cpu_replicas_float_and_gpu_replicas_see_no_gpu() -> None:
    placed = assign([("cpu", SHARES_PER_CORE)] * 3 + [("gpu", 1)] * 2, cpus=[0, 1], gpus=[])
    assert placed[:3] == [ReplicaResources(threads=1, gpus=())] * 3
    assert placed[3:] == [ReplicaResources(threads=1, gpus=())] * 2
    too_many = SHARES_PER_CORE + 1
    assert assign([("cpu", 1)] * too_many, cpus=[0], gpus=[]) == [ReplicaResources(threads=1, gpus=())] * too_many
    assert [r.gpus for r in assign([("gpu", 1)] * 3, cpus=[0], gpus=[0, 1])] == [(0,), (1,), (0,)]


def test_the_milp_counts_cpu_in_shares_of_a_core() -> None:
    assert ResourcePool.resolve({"cpu": 2, "gpu": 1}).units() == {"cpu": 2 * SHARES_PER_CORE, "gpu": 1}
