"""The profiler measures a `max_concurrency` method at concurrency levels: c calls in flight at once
on one replica, as the front-end runs it deployed, not one batch of c calls run one after another."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import patchkit
from patchkit import Component, make
from patchkit.scheduler.offline.pool import ResourcePool
from patchkit.scheduler.offline.profiler import Profiler

PAUSE_S = 0.2


@pytest.fixture(autouse=True)
def profile_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path))
    return tmp_path / "profiles"


class Engine(Component):
    """Each call waits PAUSE_S whatever the calls beside it: an engine serving concurrent calls together."""

    @make(max_concurrency=8)
    def answer(self, question: str) -> str:
        time.sleep(PAUSE_S)
        return question.upper()


def asked(engine: Engine) -> patchkit.Pipeline:
    question = "why"
    with patchkit.capture() as pipeline:  # eager: its call is what the profiler replays
        answer = engine.answer(question)  # noqa: F841 - the pipeline's output
    return pipeline


def test_a_concurrent_method_is_profiled_at_calls_in_flight_up_to_its_max_concurrency() -> None:
    profiler = Profiler(ResourcePool({"cpu": 1}), repeats=1, progress=False)  # one core: no thread counts past 1
    [profile] = profiler.run(asked(Engine()))
    points = dict(profile.methods["answer"].points)
    assert max(points) == 8 and profile.max_batch == 8
    # 8 calls at once take about as long as one; run as one batch, one by one, they took 8 times as long
    assert points[8] < 4 * points[1]
    assert points[1] >= PAUSE_S * 1000


class Uneven(Component):
    """Calls that differ in cost, as an LLM's 4-token grades and 64-token answers do."""

    @make
    def answer(self, question: str) -> str:
        time.sleep(PAUSE_S if question == "long" else 0.0)
        return question


def test_every_size_is_timed_on_the_same_mix_of_recorded_calls() -> None:
    uneven = Uneven()
    question = "short"
    with patchkit.capture() as pipeline:  # its eager call is recorded first: the cheap one
        answer = uneven.answer(question)  # noqa: F841 - the pipeline's output
    pipeline(question="long")
    profiler = Profiler(ResourcePool({"cpu": 1}), repeats=1, progress=False)
    [profile] = profiler.run(pipeline)
    points = dict(profile.methods["answer"].points)
    # one call at a time over the mix takes PAUSE_S / 2 a call on average; timing the first call alone took ~0
    assert points[1] >= 0.9 * PAUSE_S * 1000 / 2
