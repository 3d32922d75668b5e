"""A component passed to another's constructor is deployed once and shared: its holders call it through
the deployment (its queue, its replicas), not through a private copy in their own workers."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

import patchkit
from patchkit import Component, make
from patchkit.core import ensure_setup


class Engine(Component):
    """Answers with the text and the process that ran it; counts its setups."""

    def setup(self) -> None:
        self.loaded_in = os.getpid()

    @make(batch=True, max_batch_size=8)
    def run(self, text: list[str]) -> list[str]:
        return [f"{t.upper()}@{self.loaded_in}" for t in text]


class Asker(Component):
    """Holds an Engine and asks it twice per call."""

    def __init__(self, engine: Engine, prefix: str = "q") -> None:
        self.engine = engine
        self.prefix = prefix

    def setup(self) -> None:
        ensure_setup(self.engine)  # as a holder of a private engine would; a shared one is not loaded here

    @make(max_concurrency=8)
    def ask(self, text: str) -> list[str]:
        return [self.engine.run(f"{self.prefix}:{text}"), self.engine.run(f"{self.prefix}!{text}")]


engine = Engine()
first, second = Asker(engine, "a"), Asker(engine, "b")


def asked(text: str) -> Any:
    with patchkit.capture() as pipeline:
        return {"first": first.ask(text), "second": second.ask(text), "direct": engine.run(text)}
    return pipeline


def _strip(value: Any) -> Any:
    """The answers without the process ids."""
    if isinstance(value, dict):
        return {k: _strip(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_strip(v) for v in value]
    return value.split("@")[0]


@pytest.mark.slow
def test_a_component_given_to_others_is_one_deployment_serving_them_all() -> None:
    eager = asked("x")
    pipeline = patchkit.last_pipeline()
    assert sorted(pipeline.components) == ["engine", "first", "second"]  # the engine once, by its own name

    async def together(endpoint: patchkit.Endpoint) -> list[Any]:
        return list(await asyncio.gather(*(endpoint.aquery(text=t) for t in ("x", "y", "z"))))

    # A batch of the engine leaves only once it holds 3 calls: the 3 requests' calls, each request's one at a time
    with patchkit.deploy(pipeline, batch_size={"engine.run": 3}, batch_wait_ms=60_000) as endpoint:
        answers = asyncio.run(together(endpoint))
        methods = endpoint.stats()["components"]["engine"]["methods"]["run"]
    assert _strip(eager) == {"first": ["A:X", "A!X"], "second": ["B:X", "B!X"], "direct": "X"}
    assert [_strip(a) for a in answers] == [_strip(pipeline(text=t)) for t in ("x", "y", "z")]  # eager == deployed
    pids = {answer.split("@")[1] for a in answers for answer in [*a["first"], *a["second"], a["direct"]]}
    assert len(pids) == 1  # every call of the engine ran in its one replica, none in an asker's worker
    assert methods["calls"] == 3 * 5  # per request: 2 from each asker, 1 from the pipeline
    assert methods["batches"] == 5  # the askers' calls met in the engine's queue, a call of each request per batch


def test_the_holders_calls_count_in_the_shared_components_visits() -> None:
    from patchkit.scheduler.offline.profiler import visits_by_component

    asked("v")
    visits = visits_by_component(patchkit.last_pipeline())
    assert visits["engine"] == {"run": 5.0}  # 2 per asker, 1 from the pipeline: what plans give it replicas for
    assert visits["first"] == {"ask": 1.0} and visits["second"] == {"ask": 1.0}


class Wrapper(Component):
    """Uses its engine's state directly, so it names it in `in_place`: a private part, not a deployment."""

    in_place = ("engine",)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def setup(self) -> None:
        ensure_setup(self.engine)

    @make
    def where(self, text: str) -> str:
        return f"{text}@{self.engine.loaded_in}@{os.getpid()}"


@pytest.mark.slow
def test_a_parameter_the_holder_runs_in_place_stays_a_private_part() -> None:
    wrapper = Wrapper(Engine())

    def wrapped(text: str) -> Any:
        with patchkit.capture() as pipeline:
            return wrapper.where(text)
        return pipeline

    wrapped("x")
    pipeline = patchkit.last_pipeline()
    assert list(pipeline.components) == ["wrapper"]
    with patchkit.deploy(pipeline) as endpoint:
        _, loaded_in, ran_in = endpoint.query(text="y").split("@")
    assert loaded_in == ran_in  # the engine was set up in the wrapper's own worker
