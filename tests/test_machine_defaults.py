"""deploy() with no plan sizes a pipeline of an LLM engine and a retriever for the cores it finds, as the planner would."""

from __future__ import annotations

import pytest

import patchkit
from patchkit.components import FaissRetriever, LlamaCppGenerator
from patchkit.components.testing import Simulated
from patchkit.config import DeploymentConfig
from patchkit.orchestrator.resources import SHARES_PER_CORE, assign


def _rag() -> patchkit.Pipeline:
    retriever = FaissRetriever("pydoc", topk=2)  # nothing loads until a worker sets it up
    llm = LlamaCppGenerator(max_tokens=16)
    question = "What does heapq.merge return?"
    with patchkit.capture(run=False, output="answer") as pipeline:
        docs = retriever.retrieve(question)
        answer = llm.generate(question, docs)  # noqa: F841 - the block's output
    return pipeline


def _machine(monkeypatch: pytest.MonkeyPatch, cores: int, gpus: int = 0) -> None:
    monkeypatch.setattr("patchkit.config.machine.available_cpus", lambda: list(range(cores)))
    monkeypatch.setattr("patchkit.config.machine.available_gpus", lambda: list(range(gpus)))


def _names(config: DeploymentConfig) -> tuple[str, str]:
    llm = next(name for name in config.components if "llm" in name.lower() or "generator" in name.lower())
    retriever = next(name for name in config.components if name != llm)
    return llm, retriever


@pytest.mark.parametrize("cores", [1, 2, 4, 6])
def test_an_unplanned_engine_gets_one_replica_with_a_thread_on_every_core(monkeypatch: pytest.MonkeyPatch, cores: int) -> None:
    _machine(monkeypatch, cores)
    pipeline = _rag()
    config = DeploymentConfig.resolve(pipeline, backend="local")
    llm, retriever = _names(config)
    # a lone request computes on every core; many batch in the one engine
    assert config.components[llm].replicas == 1
    assert config.components[llm].units == cores * SHARES_PER_CORE - 1  # every core, an eighth of the last lent
    assert (config.components[retriever].replicas, config.components[retriever].units) == (1, 1)
    assert config.plan is not None and config.plan["solver"] == "machine"
    assert config.plan["components"][llm]["threads"] == cores
    resources = assign([(c.resource, c.units) for c in config.components.values()], cpus=list(range(cores)))
    assert sorted(r.threads or 0 for r in resources) == sorted([cores, 1])
    assert sorted(len(r.cpus) for r in resources) == sorted([cores, 1])
    # each method keeps the batch size its component declares, as an unplanned deployment always did
    unplanned = DeploymentConfig.resolve(pipeline, backend="local", replicas=1)
    assert {n: c.batch_sizes for n, c in config.components.items()} == {n: c.batch_sizes for n, c in unplanned.components.items()}


def test_sizes_given_by_hand_or_another_backend_keep_one_replica_each(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 4)
    pipeline = _rag()
    for given in ({"replicas": 1}, {"batch_size": 4}, {"backend": "inprocess"}, {"min_replicas": 1}):
        config = DeploymentConfig.resolve(pipeline, **{"backend": "local", **given})
        assert config.plan is None, given
        assert {c.replicas for c in config.components.values()} == {1}, given


def test_a_machine_with_a_gpu_or_a_pipeline_without_an_engine_is_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, 4, gpus=1)
    assert DeploymentConfig.resolve(_rag(), backend="local").plan is None
    _machine(monkeypatch, 4)
    light = Simulated(0)
    x = "1"
    with patchkit.capture(run=False, output="y") as pipeline:
        y = light.run(x)  # noqa: F841 - the block's output
    config = DeploymentConfig.resolve(pipeline, backend="local")
    assert config.plan is None and {c.replicas for c in config.components.values()} == {1}
