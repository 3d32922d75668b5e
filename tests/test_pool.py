"""Resource pools (detected or declared) and placing a plan's replicas on cores and GPUs."""

from __future__ import annotations

import pytest

import patchkit
from patchkit.orchestrator.resources import ReplicaResources, assign, available_gpus
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
    placed = assign([("cpu", 2), ("cpu", 1), ("gpu", 1)], cpus=[0, 1, 2, 3], gpus=[5])
    assert placed == [
        ReplicaResources(cpus=(0, 1), threads=2, gpus=()),
        ReplicaResources(cpus=(2,), threads=1, gpus=()),
        ReplicaResources(threads=1, gpus=(5,)),
    ]


def test_past_the_machine_cpu_replicas_float_and_gpu_replicas_see_no_gpu() -> None:
    placed = assign([("cpu", 1)] * 3 + [("gpu", 1)] * 2, cpus=[0, 1], gpus=[])
    assert placed[:3] == [ReplicaResources(threads=1, gpus=())] * 3
    assert placed[3:] == [ReplicaResources(threads=1, gpus=())] * 2
    assert [r.gpus for r in assign([("gpu", 1)] * 3, cpus=[0], gpus=[0, 1])] == [(0,), (1,), (0,)]
