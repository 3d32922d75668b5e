"""Profiling shows what it does and how long is left: a line per profile, and on a terminal the step
under way with the time left, estimated from the profiles' estimates and how the finished ones went."""

from __future__ import annotations

import io

import pytest

from patchkit.scheduler.offline import progress as progress_module
from patchkit.scheduler.offline.progress import PRIOR_S, Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", clock)
    return clock


def test_the_time_left_is_the_estimates_scaled_by_how_the_finished_profiles_went(clock: Clock) -> None:
    progress = Progress(enabled=True, stream=Terminal())
    progress.expect("retriever", 10.0)
    progress.expect("llm", 30.0)
    assert progress.seconds_left() == pytest.approx(40.0)
    progress.begin("retriever")
    clock.now = 4.0
    assert progress.seconds_left() == pytest.approx(36.0)  # 4 s of the retriever's 10 are spent
    clock.now = 30.0
    progress.done("retriever", "retriever: 1-64 measured", measured=True)
    scale = (30 + PRIOR_S) / (10 + PRIOR_S)  # it took 3 times its estimate: so may the llm, damped by the prior
    assert progress.seconds_left() == pytest.approx(30.0 * scale)
    progress.begin("llm")
    clock.now = 40.0
    assert progress.seconds_left() == pytest.approx(30.0 * scale - 10.0)


def test_a_terminal_shows_the_step_under_way_and_a_line_per_profile(clock: Clock) -> None:
    terminal = Terminal()
    progress = Progress(enabled=True, stream=terminal)
    progress.expect("llm on cpu, 1 thread", 30.0)
    progress.expect("web on cpu, 1 thread", 0.0)
    progress.begin("llm on cpu, 1 thread")
    progress.note("llm.generate: decode steps, 4 calls at once")
    assert "profiling [0/2] llm.generate: decode steps, 4 calls at once · about 30 s left" in terminal.getvalue()
    clock.now = 12.0
    progress.done("llm on cpu, 1 thread", "llm on cpu, 1 thread: generate: cost model", measured=True)
    progress.begin("web on cpu, 1 thread")
    progress.done("web on cpu, 1 thread", "web on cpu, 1 thread: search: 1-64 measured", measured=False)
    lines = [line.strip() for line in terminal.getvalue().replace("\r", "\n").splitlines() if line.startswith("profiled")]
    assert lines == [
        "profiled [1/2] llm on cpu, 1 thread: generate: cost model (12.0 s)",
        "profiled [2/2] web on cpu, 1 thread: search: 1-64 measured (cached)",
    ]


def test_a_log_gets_the_finished_profiles_only() -> None:
    log = io.StringIO()
    progress = Progress(enabled=True, stream=log)
    progress.expect("web", 1.0)
    progress.begin("web")
    progress.note("web.search: batch 8")
    progress.done("web", "web: search: 1-8 measured", measured=True)
    progress.close()
    assert "web.search" not in log.getvalue()
    assert log.getvalue().startswith("profiled [1/1] web: search: 1-8 measured (")
    assert "profiling took" in log.getvalue()
