"""The profiler measures a `max_concurrency` method at concurrency levels: c calls in flight at once
on one replica, as the front-end runs it deployed, not one batch of c calls run one after another.
And it times every size on the same mix of recorded calls.

The components note in a log what their worker ran (each line one append, so lines from threads and
processes never interleave); the tests count from the log, not from the profiler's timings."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import patchkit
from patchkit import Component, make
from patchkit.scheduler.offline.pool import ResourcePool
from patchkit.scheduler.offline.profiler import Profiler

pytestmark = pytest.mark.slow  # the profiler runs each component in a worker process

PAUSE_S = 0.2


@pytest.fixture(autouse=True)
def profile_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path))
    return tmp_path / "profiles"


def note(log: str, line: str) -> None:
    with open(log, "a") as out:  # O_APPEND, one short write: atomic
        out.write(line + "\n")


class Engine(Component):
    """Each call waits PAUSE_S whatever the calls beside it: an engine serving concurrent calls together.
    Notes "+" in `log` as a call starts and "-" as it ends."""

    def __init__(self, log: str) -> None:
        self.log = log

    @make(max_concurrency=8)
    def answer(self, question: str) -> str:
        note(self.log, "+")
        time.sleep(PAUSE_S)
        note(self.log, "-")
        return question.upper()


def most_at_once(log: Path) -> int:
    """The most calls the log shows running at the same time."""
    running = most = 0
    for line in log.read_text().split():
        running += 1 if line == "+" else -1
        most = max(most, running)
    return most


def asked(engine: Engine) -> patchkit.Pipeline:
    question = "why"
    with patchkit.capture() as pipeline:  # eager: its call is what the profiler replays
        answer = engine.answer(question)  # noqa: F841 - the pipeline's output
    return pipeline


def test_a_concurrent_method_is_profiled_at_calls_in_flight_up_to_its_max_concurrency(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    pipeline = asked(Engine(str(log)))
    log.write_text("")  # the eager call ran here; from now on the log is the profiler's worker
    profiler = Profiler(ResourcePool({"cpu": 1}), repeats=1, progress=False)  # one core: no thread counts past 1
    [profile] = profiler.run(pipeline)
    points = dict(profile.methods["answer"].points)
    assert max(points) == 8 and profile.max_batch == 8
    # 8 calls in flight at once on the one replica; run as one batch, one call after another, never more than 1
    assert most_at_once(log) == 8
    assert points[1] >= PAUSE_S * 1000  # a point is the time of a whole call: time.sleep never returns early


class Uneven(Component):
    """Calls that differ in cost, as an LLM's 4-token grades and 64-token answers do. Notes each
    question in `log` as its call starts."""

    def __init__(self, log: str) -> None:
        self.log = log

    @make
    def answer(self, question: str) -> str:
        note(self.log, question)
        time.sleep(PAUSE_S if question == "long" else 0.0)
        return question


def test_every_size_is_timed_on_the_same_mix_of_recorded_calls(tmp_path: Path) -> None:
    log = tmp_path / "calls.log"
    uneven = Uneven(str(log))
    question = "short"
    with patchkit.capture() as pipeline:  # its eager call is recorded first: the cheap one
        answer = uneven.answer(question)  # noqa: F841 - the pipeline's output
    pipeline(question="long")
    log.write_text("")  # the eager calls ran here; from now on the log is the profiler's worker
    profiler = Profiler(ResourcePool({"cpu": 1}), repeats=1, progress=False)
    [profile] = profiler.run(pipeline)
    assert [size for size, _ in profile.methods["answer"].points] == [1]  # a per-item method: batch 1 only
    # batch 1 ran the recorded mix, the costly call as often as the cheap one, not the first call alone
    ran = log.read_text().split()
    assert ran.count("long") == ran.count("short") > 0 and len(ran) == 2 * ran.count("long")
