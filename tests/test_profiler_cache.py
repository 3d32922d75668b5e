"""Profiles are cached by what they were measured on: a second plan of the same pipeline and calibration
starts no worker, in the same process or with components built again; a holder's profile is its own work."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import patchkit
from patchkit import Component, make
from patchkit.components.testing import Simulated
from patchkit.scheduler.offline.cache import digest
from patchkit.scheduler.offline.pool import ResourcePool
from patchkit.scheduler.offline.profiler import Profiler

POOL = {"cpu": 2, "gpu": 0}
NAP_S = 0.2


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("profile_cache")]  # profiles cached under each test's directory


class Sleeper(Component):
    @make
    def nap(self, text: str) -> str:
        time.sleep(NAP_S)
        return text.upper()


class Napper(Component):
    """Holds a Sleeper, deployed on its own: its calls of it are the sleeper's work, not its own."""

    def __init__(self, sleeper: Sleeper, mark: str = "!") -> None:
        self.sleeper, self.mark = sleeper, mark

    @make
    def ask(self, text: str) -> str:
        return self.sleeper.nap(text) + self.mark


def crag_shaped() -> patchkit.Pipeline:
    """Built anew at each call: new components (new uids), alike."""
    retriever, sleeper = Simulated(lambda b: 1.0 + 0.1 * b), Sleeper()
    napper = Napper(sleeper)
    question = "q"
    with patchkit.capture(run=False) as pipeline:
        docs = retriever.run(question)
        answer = napper.ask(docs)  # noqa: F841 - the pipeline's output
    return pipeline


CALIBRATION = [{"question": "a"}, {"question": "b"}]


def test_a_second_plan_with_the_same_calibration_profiles_nothing(workers_started: list[str]) -> None:
    pipeline = crag_shaped()
    first = patchkit.plan(pipeline, resources=POOL, calibration=CALIBRATION, progress=False)
    assert workers_started  # the first plan profiled
    workers_started.clear()
    again = patchkit.plan(pipeline, resources=POOL, calibration=CALIBRATION, progress=False)
    assert workers_started == []  # the calibration's calls are the same, and so are the profiles
    assert again.to_dict() == first.to_dict()


def test_a_pipeline_built_again_alike_plans_from_the_cache(workers_started: list[str]) -> None:
    patchkit.plan(crag_shaped(), resources=POOL, calibration=CALIBRATION, progress=False)
    workers_started.clear()
    patchkit.plan(crag_shaped(), resources=POOL, calibration=CALIBRATION, progress=False)  # as a new process would
    assert workers_started == []


class Tally(Component):
    """Notes the calls it runs in a file, by process: this one's are the calibration's eager runs (profiling runs
    it in workers). A file, not a global its code reads: such a global is part of its version, which notes change."""

    def __init__(self, log: str) -> None:
        self.log = log

    @make
    def note(self, text: str) -> str:
        with open(self.log, "a") as file:
            file.write(f"{os.getpid()} {text}\n")
        return text + "."


def eager_calls(log: Path) -> list[str]:
    """The calls the Tally ran in this process."""
    return [text for pid, text in (line.split(" ", 1) for line in log.read_text().splitlines()) if int(pid) == os.getpid()]


def tallied(log: Path) -> patchkit.Pipeline:
    tally, sleeper = Tally(str(log)), Sleeper()
    question = "q"
    with patchkit.capture(run=False) as pipeline:
        noted = tally.note(question)
        answer = sleeper.nap(noted)  # noqa: F841 - the pipeline's output
    return pipeline


def test_a_plan_made_again_reads_its_calibration_runs_back_and_runs_nothing_here(workers_started: list[str],
                                                                                 tmp_path: Path) -> None:
    """As `patchkit plan` run again in a new process: no model loads and no call runs for the calibration."""
    log = tmp_path / "eager.log"
    log.write_text("")
    first = patchkit.plan(tallied(log), resources=POOL, calibration=CALIBRATION, progress=False)
    assert eager_calls(log) == ["a", "b"]
    workers_started.clear()
    again = tallied(log)
    second = patchkit.plan(again, resources=POOL, calibration=CALIBRATION, progress=False)
    assert eager_calls(log) == ["a", "b"] and workers_started == []  # nothing ran, here or in a worker
    assert second.to_dict() == first.to_dict()
    assert again.graph.runs == 2 and [c.args for c in again.recorded] == [("a",), ("a.",), ("b",), ("b.",)]
    patchkit.plan(tallied(log), resources=POOL, calibration=[{"question": "c"}], progress=False)
    assert eager_calls(log) == ["a", "b", "c"]  # a new input runs


def test_other_calibration_inputs_are_profiled(workers_started: list[str]) -> None:
    patchkit.plan(crag_shaped(), resources=POOL, calibration=CALIBRATION, progress=False)
    workers_started.clear()
    patchkit.plan(crag_shaped(), resources=POOL, calibration=[{"question": "c"}], progress=False)
    assert workers_started


def test_the_cache_key_reads_components_by_their_arguments_not_their_identity() -> None:
    sleeper = Sleeper()
    assert digest(Napper(sleeper)) == digest(Napper(Sleeper()))
    assert digest(Napper(sleeper, "?")) != digest(Napper(sleeper))
    assert digest({"b", "a", "c"}) == digest({"c", "a", "b"})


def test_a_holders_profile_is_its_own_work_not_the_calls_it_makes_of_what_it_holds() -> None:
    pipeline = crag_shaped()
    pipeline(question="a")
    profiles = {p.component: p for p in Profiler(ResourcePool({"cpu": 1}), progress=False).run(pipeline)}
    own = dict(profiles["napper"].methods["ask"].points)[1]
    held = dict(profiles["napper_sleeper"].methods["nap"].points)[1]
    assert held >= NAP_S * 1000  # the sleeper is profiled on its own, as it is deployed
    assert own < NAP_S * 1000 / 4  # the napper's calls of it were answered from the calibration run


WORKER_SOURCE = '''\
import time

import patchkit
from patchkit import Component, make


class Worker(Component):
    @make
    def work(self, text: str) -> str:
        time.sleep({seconds})
        return text.upper()


def answer():
    worker = Worker()
    question = "q"
    with patchkit.capture(run=False) as pipeline:
        return worker.work(question)
    return pipeline
'''


def _worker_pipeline(seconds: float) -> patchkit.Pipeline:
    """A script's pipeline run again after its method was edited: a new module, a new class."""
    import types

    made = types.ModuleType("worker_app")
    exec(compile(WORKER_SOURCE.format(seconds=seconds), "worker_app.py", "exec"), made.__dict__)  # noqa: S102
    made.answer()
    return patchkit.last_pipeline()


def test_a_method_edited_to_do_more_is_profiled_again(workers_started: list[str]) -> None:
    """The profile cache keys by the component's version: a method 50x slower is measured again, not read back."""
    fast = patchkit.plan(_worker_pipeline(0.004), resources=POOL, calibration=CALIBRATION, progress=False)
    workers_started.clear()
    patchkit.plan(_worker_pipeline(0.004), resources=POOL, calibration=CALIBRATION, progress=False)
    assert workers_started == []  # the same code: read back
    slow = patchkit.plan(_worker_pipeline(0.2), resources=POOL, calibration=CALIBRATION, progress=False)
    assert workers_started  # measured again
    assert slow.components["worker"].throughput < fast.components["worker"].throughput / 10
