"""`Simulated`: batches take the time they are told to, on the resource named, and answer deterministically.

What a batch takes is checked on the clock it runs on: the module's `time` is replaced by a fake
that records each sleep and advances on each read, so no assertion depends on how busy the machine is.
"""

from __future__ import annotations

import math
from typing import Any

import cloudpickle
import pytest

import patchkit
from patchkit.components import testing
from patchkit.components.testing import Simulated


class FakeTime:
    """Stands in for the `time` module inside `patchkit.components.testing`."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []
        self.reads = 0

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def perf_counter(self) -> float:
        self.reads += 1
        self.now += 0.001  # every read of the clock takes a millisecond
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    fake = FakeTime()
    monkeypatch.setattr(testing, "time", fake)
    return fake


def run_batch(component: Simulated, items: list[Any]) -> list[Any]:
    """Run one batch of `items` as a worker does; returns the answers."""
    return type(component).run.run_batch(component, [((item,), {}) for item in items])


# -- latency ---------------------------------------------------------------------------------------
def test_a_number_is_the_time_of_any_batch(clock: FakeTime) -> None:
    simulated = Simulated(20.0)
    assert [simulated.batch_ms(b) for b in (1, 10, 64)] == [20.0, 20.0, 20.0]
    run_batch(simulated, list(range(10)))
    assert clock.slept == [pytest.approx(0.020)]


def test_a_function_of_the_batch_size_gives_the_time(clock: FakeTime) -> None:
    simulated = Simulated(lambda b: 2.0 * b)
    assert simulated.batch_ms(1) == 2.0 and simulated.batch_ms(16) == 32.0
    run_batch(simulated, list(range(12)))
    assert clock.slept == [pytest.approx(0.024)]


def test_points_are_interpolated_and_flat_beyond_the_ends(clock: FakeTime) -> None:
    simulated = Simulated([(20, 40.0), (4, 8.0)], max_batch=64)
    assert simulated.batch_ms(1) == 8.0 and simulated.batch_ms(4) == 8.0
    assert simulated.batch_ms(12) == pytest.approx(24.0)
    assert simulated.batch_ms(50) == 40.0
    run_batch(simulated, list(range(12)))
    assert clock.slept == [pytest.approx(0.024)]


def test_a_batch_larger_than_max_batch_runs_in_parts(clock: FakeTime) -> None:
    simulated = Simulated(lambda b: 5.0 * b, max_batch=4)
    assert run_batch(simulated, list(range(10))) == list(range(10))
    assert clock.slept == [pytest.approx(0.020), pytest.approx(0.020), pytest.approx(0.010)]


def test_sleep_waits_without_the_cpu_and_spin_keeps_it_busy(clock: FakeTime) -> None:
    run_batch(Simulated(40.0, work="sleep"), [1])
    assert clock.slept == [pytest.approx(0.040)] and clock.reads == 0
    run_batch(Simulated(100.0, work="spin"), [1])
    assert clock.slept == [pytest.approx(0.040)]  # no sleep: it reads the clock until the batch time has passed
    assert clock.reads >= 100 and clock.now >= 0.140


def test_resource_sets_the_devices_a_replica_runs_on() -> None:
    assert Simulated(1.0).devices == ("cpu",)
    assert Simulated(1.0, resource="gpu").devices == ("gpu",)
    assert Simulated(1.0, max_batch=70).max_batch == 70


# -- outputs ---------------------------------------------------------------------------------------
def test_outputs_are_the_inputs_a_mapping_of_them_or_a_constant() -> None:
    items = ["a", "b", "c"]
    assert run_batch(Simulated(0.0), items) == items
    assert run_batch(Simulated(0.0, output=str.upper), items) == ["A", "B", "C"]
    assert run_batch(Simulated(0.0, output={"answer": 42}), items) == [{"answer": 42}] * 3
    assert Simulated(0.0, output=len).run("abcd") == 4  # a pipeline's single call: a batch of one


# -- arguments -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("latency", "options", "error", "message"),
    [
        (-1.0, {}, ValueError, "latency_ms must be a finite number of milliseconds >= 0; got -1.0"),
        (math.inf, {}, ValueError, "finite"),
        (lambda b: -b, {}, ValueError, r"latency_ms\(1\) must be a finite number of milliseconds >= 0; got -1"),
        (lambda b: "fast", {}, ValueError, r"latency_ms\(1\) must be a finite number"),
        ([], {}, ValueError, "no \\(batch, ms\\) point"),
        ([(0, 1.0)], {}, ValueError, "the batch must be > 0"),
        ([(1, -1.0)], {}, ValueError, "milliseconds >= 0"),
        ([(1, 1.0), (1, 2.0)], {}, ValueError, "lists batch 1 twice"),
        ([(1, 1.0, 3)], {}, TypeError, "pairs of numbers"),
        ("10", {}, TypeError, "got str"),
        (True, {}, TypeError, "got a bool"),
        (1.0, {"resource": "tpu"}, ValueError, "resource must be one of 'cpu', 'gpu'; got 'tpu'"),
        (1.0, {"work": "nap"}, ValueError, "work must be one of 'sleep', 'spin'; got 'nap'"),
        (1.0, {"max_batch": 0}, ValueError, "max_batch must be an int >= 1; got 0"),
        (1.0, {"max_batch": 2.5}, ValueError, "max_batch must be an int >= 1; got 2.5"),
    ],
)
def test_bad_arguments_fail_at_construction(latency: Any, options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        Simulated(latency, **options)


def test_lambdas_travel_with_cloudpickle() -> None:
    rebuilt = cloudpickle.loads(cloudpickle.dumps(Simulated(lambda b: 3.0 * b, max_batch=8, output=lambda x: x * 2)))
    assert isinstance(rebuilt, Simulated) and rebuilt.batch_ms(4) == 12.0 and rebuilt.max_batch == 8
    assert run_batch(rebuilt, [1, 2]) == [2, 4]


# -- deployed --------------------------------------------------------------------------------------
retriever = Simulated(lambda b: 0.5 * b, output=lambda q: f"docs({q})")
generator = Simulated([(1, 2.0), (8, 4.0)], resource="gpu", max_batch=8, output=lambda d: f"answer({d})")


def rag(query: str) -> str:
    with patchkit.capture():
        return generator.run(retriever.run(query))


def captured() -> patchkit.Pipeline:
    assert rag("q") == "answer(docs(q))"  # the eager run
    return patchkit.last_pipeline()


def test_deployed_inprocess_it_answers_as_it_does_eagerly() -> None:
    with patchkit.deploy(captured(), backend="inprocess") as endpoint:
        assert [endpoint.query(query=q) for q in ("a", "b")] == ["answer(docs(a))", "answer(docs(b))"]


@pytest.mark.slow
def test_deployed_on_worker_processes_its_lambdas_are_rebuilt_there() -> None:
    with patchkit.deploy(captured()) as endpoint:
        assert [endpoint.query(query=q) for q in ("a", "b")] == ["answer(docs(a))", "answer(docs(b))"]
