"""`patchkit.plan`: calibration runs, profiling in worker processes, the MILP, and deploying the plan.

Patchwork's worked example (section 2.3) is built from Simulated components of known cost, planned
for 5 CPUs and 2 GPUs (virtual here), and must come out as the paper says.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import pytest
from components import Generator, Grader, Retriever

import patchkit
from patchkit.components.testing import Simulated
from patchkit.errors import PlanWarning
from patchkit.orchestrator.backend import Replica, ReplicaSpec
from patchkit.orchestrator.local import LocalBackend
from patchkit.orchestrator.resources import SHARE_SIZES, SHARES_PER_CORE, available_cpus, lent_shares
from patchkit.scheduler.offline.plan import ComponentPlan, Plan

pytestmark = pytest.mark.slow

POOL = {"cpu": 5, "gpu": 2}
CORES = len(available_cpus())


@pytest.fixture(autouse=True)
def profile_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path))
    return tmp_path / "profiles"


def rag(retriever: Simulated) -> patchkit.Pipeline:
    augmenter = Simulated(lambda b: 1.0 * b)
    generator = Simulated(10.0, resource="gpu", max_batch=70)
    query = "q"
    with patchkit.capture() as pipeline:
        docs = retriever.run(query)
        prompt = augmenter.run(docs)
        answer = generator.run(prompt)  # noqa: F841 - the pipeline's output
    return pipeline


def test_the_worked_example_of_patchwork_section_2_3() -> None:
    made = patchkit.plan(rag(Simulated(lambda b: 2.0 * b)), resources=POOL, progress=False)
    placed = {name: (c.resource, c.replicas) for name, c in made.components.items()}
    assert placed == {"retriever": ("cpu", 3), "augmenter": ("cpu", 2), "generator": ("gpu", 1)}
    assert made.used() == {"cpu": 5, "gpu": 1}  # the second GPU stays free
    assert made.bottleneck == "retriever"
    assert made.virtual == ("cpu", "gpu")  # this machine has 2 cores and no GPU
    # The bottleneck sets the pace: 3 replicas at 2 ms per query at best (a measured batch is never shorter
    # than its sleeps), less the process hop; the plan reads T(b) from a fit that may sit up to its 5%
    # tolerance below the measured times, so its estimate may pass 1500 by as much
    retriever = made.components["retriever"]
    assert made.throughput == pytest.approx(retriever.throughput / retriever.visits)
    assert 0 < made.throughput <= 1500 * 1.05


def test_a_retriever_that_batches_for_free_moves_the_bottleneck_to_the_augmenter() -> None:
    made = patchkit.plan(rag(Simulated(2.0)), resources=POOL, progress=False)  # ChromaDB-like: 2 ms per batch
    placed = {name: (c.resource, c.replicas) for name, c in made.components.items()}
    assert placed == {"retriever": ("cpu", 1), "augmenter": ("cpu", 4), "generator": ("gpu", 1)}
    assert made.bottleneck == "augmenter" and made.components["augmenter"].units == SHARES_PER_CORE
    # T is flat, so calls/s grow with the batch: a share of a core keeps up with the augmenter's 4 cores at large batches
    retriever = made.components["retriever"]
    assert retriever.shared and retriever.batch_size > 16


def test_visits_count_branches_and_loops_on_the_calibration_inputs() -> None:
    step, rare = Simulated(1.0), Simulated(1.0)
    rounds, flag = 2, False
    with patchkit.capture(run=False) as pipeline:
        for _ in range(rounds):
            x = step.run(rounds)
        if flag:
            x = rare.run(x)
    made = patchkit.plan(
        pipeline, resources={"cpu": 2, "gpu": 0}, calibration=[{"rounds": 2, "flag": True}, {"rounds": 4, "flag": False}],
        progress=False,
    )
    assert made.components["step"].visits == 3.0
    assert made.components["rare"].visits == 0.5


def crag_on_the_corpus(question: str) -> patchkit.Pipeline:
    """CRAG's shape on the corpus components, captured eagerly on `question`: a question the corpus has
    no words of takes the rewrite branch."""
    retriever, grader, rewriter, llm = Retriever(), Grader(threshold=1), Generator("R"), Generator("A")
    with patchkit.capture() as pipeline:
        docs = retriever.retrieve(question)
        if not grader.grade(question, docs):
            docs = retriever.retrieve(rewriter.rewrite(question))
        answer = llm.generate(question, docs)  # noqa: F841 - the pipeline's output
    return pipeline


def test_a_branch_the_calibration_leaves_untaken_is_profiled_with_the_inputs_the_capture_recorded() -> None:
    pipeline = crag_on_the_corpus("Monads, burritos?")  # no document: the capture took the rewrite branch
    calibration = [{"question": "How do I catch an exception?"}, {"question": "What does a decorator do?"}]
    with pytest.warns(PlanWarning, match=r"rewriter\.rewrite was never called on the calibration inputs; profiled with "
                      r"its own calls recorded before the calibration .*\(1 call\)"):
        made = patchkit.plan(pipeline, resources={"cpu": 2, "gpu": 0}, calibration=calibration, progress=False)
    rewriter = made.components["rewriter"]
    assert rewriter.visits == pytest.approx(1 / 3)  # the capture's run took the branch, the calibration's two did not
    assert rewriter.replicas >= 1 and rewriter.throughput > 0  # profiled and planned like the others
    assert made.components["retriever"].visits == pytest.approx(4 / 3)
    assert made.throughput > 0


@pytest.mark.skipif(CORES < 2, reason="needs 2 cores")
def test_the_next_worker_starts_on_the_other_core_while_one_is_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str, tuple[int, ...]]] = []
    start, stop = LocalBackend.start, LocalBackend.stop

    async def started(self: LocalBackend, spec: ReplicaSpec, replica_id: str) -> Replica:
        events.append(("start", spec.component, tuple(spec.resources.cpus)))  # when its start begins
        return await start(self, spec, replica_id)

    async def stopped(self: LocalBackend, replica: Replica) -> None:
        events.append(("stop", replica.spec.component, ()))
        await stop(self, replica)

    monkeypatch.setattr(LocalBackend, "start", started)
    monkeypatch.setattr(LocalBackend, "stop", stopped)
    first, second = Simulated(lambda b: 1.0 * b), Simulated(lambda b: 1.0 * b)
    query = "q"
    with patchkit.capture() as pipeline:
        y = second.run(first.run(query))  # noqa: F841 - the pipeline's output
    patchkit.plan(pipeline, resources={"cpu": 1, "gpu": 0}, progress=False)  # 1 declared: 1 thread each, no more
    assert [e[:2] for e in events] == [("start", "first"), ("start", "second"), ("stop", "first"), ("stop", "second")]
    assert events[0][2] != events[1][2] and len(events[0][2]) == len(events[1][2]) == 1  # one core each, not the same


def test_profiles_are_cached_on_disk(profile_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pipeline = rag(Simulated(lambda b: 2.0 * b))
    first = patchkit.plan(pipeline, resources=POOL, progress=False)
    # one per component and resource type, and the CPU ones again at 2 threads where there are 2 cores
    assert len(list(profile_cache.glob("*.json"))) == 3 + (2 if CORES > 1 else 0)

    async def no_workers(*args: object) -> None:
        raise AssertionError("profiled again instead of reading the cache")

    monkeypatch.setattr(LocalBackend, "start", no_workers)
    again = patchkit.plan(pipeline, resources=POOL, progress=False)
    assert again.to_dict() == first.to_dict()


def test_a_pipeline_that_never_ran_needs_calibration_inputs() -> None:
    component = Simulated(1.0)
    with patchkit.capture(run=False) as pipeline:
        y = component.run(1)  # noqa: F841 - the pipeline's output
    with pytest.raises(patchkit.PlanError, match="never run.*calibration="):
        patchkit.plan(pipeline, resources={"cpu": 1})


def test_more_components_than_resources_is_a_clear_error() -> None:
    a, b, c, d, e, f, g, h, i = (Simulated(1.0) for _ in range(9))
    with patchkit.capture() as pipeline:
        z = i.run(h.run(g.run(f.run(e.run(d.run(c.run(b.run(a.run(1)))))))))
    assert SHARES_PER_CORE == 8  # a core holds 8 shares: 9 components need 9, which 2 cores hold
    with pytest.raises(patchkit.PlanError, match=r"9 components need a cpu replica each .* resources=\{'cpu': 2\}"):
        patchkit.plan(pipeline, resources={"cpu": 1, "gpu": 0}, progress=False)
    assert z == 1


def test_deploy_applies_the_plan_and_serves_it() -> None:
    pipeline = rag(Simulated(lambda b: 2.0 * b))
    with patchkit.deploy(pipeline, plan="auto", resources=POOL) as endpoint:
        assert endpoint.query(query="hello") == "hello"
        stats = endpoint.stats()
        served = endpoint.plan()
    replicas = {name: len(c["replicas"]) for name, c in stats["components"].items()}
    assert replicas == {"retriever": 3, "augmenter": 2, "generator": 1}
    gpu = stats["components"]["generator"]["replicas"][0]["resources"]
    assert gpu["gpus"] == []  # a virtual GPU: the replica sees none
    assert served["plan"]["bottleneck"] == "retriever"
    assert served["components"]["generator"]["batch_sizes"] == {"run": served["plan"]["components"]["generator"]["batch_size"]}


def placement(endpoint: patchkit.Endpoint) -> dict[str, list[tuple[list[int], str]]]:
    """Per component, each worker process's real (cores it may run on, OMP_NUM_THREADS), read from the OS."""
    found = {}
    for name, component in endpoint.stats()["components"].items():
        found[name] = []
        for replica in component["replicas"]:
            environ = Path(f"/proc/{replica['pid']}/environ").read_bytes().split(b"\0")
            threads = next(v for k, _, v in (e.decode().partition("=") for e in environ) if k == "OMP_NUM_THREADS")
            found[name].append((sorted(os.sched_getaffinity(replica["pid"])), threads))
    return found


@pytest.mark.skipif(CORES < 2 or not hasattr(os, "sched_getaffinity"), reason="needs 2 cores and Linux affinity")
def test_five_components_plan_and_start_on_two_cores_without_oversubscription() -> None:
    """CRAG's shape: an LLM and four light components on 2 cores. Each planned replica runs pinned,
    with its threads: replicas of whole cores alone on their cores, never more shares on a core than it has."""
    cores = available_cpus()[:2]
    llm = Simulated(lambda b: 20.0 * b, work="spin")
    retriever, grader, rewriter, web = (Simulated(lambda b: 0.2 * b) for _ in range(4))
    query = "q"
    with patchkit.capture() as pipeline:
        docs = retriever.run(query)
        if grader.run(docs):
            docs = web.run(rewriter.run(docs))
        answer = llm.run(docs)
    with patchkit.deploy(pipeline, plan="auto", resources={"cpu": 2, "gpu": 0}) as endpoint:
        assert endpoint.query(query="hello") == "hello" and answer == "q"
        planned = endpoint.plan()["plan"]["components"]
        placed = placement(endpoint)
    # the LLM on both cores, a 1-thread replica on each, lending part of it to the light ones
    assert (planned["llm"]["replicas"], planned["llm"]["threads"]) == (2, 1) and planned["llm"]["units"] < SHARES_PER_CORE
    given, held = Counter(), Counter()
    for name, replicas in placed.items():
        units, threads = planned[name]["units"], planned[name]["threads"]
        for affinity, omp in replicas:
            assert omp == str(threads) and set(affinity) <= set(cores) and len(affinity) == threads
            if units in SHARE_SIZES:
                given[affinity[0]] += units
                continue
            held.update(affinity)
            given.update(dict.fromkeys(affinity, SHARES_PER_CORE))
            given[affinity[-1]] -= lent_shares(units)
    assert all(n == 1 for n in held.values())
    assert all(n <= SHARES_PER_CORE for n in given.values())


@pytest.mark.skipif(CORES < 2 or not hasattr(os, "sched_getaffinity"), reason="needs 2 cores and Linux affinity")
def test_a_replica_of_two_threads_runs_on_two_cores_with_omp_num_threads_2() -> None:
    pipeline = rag(Simulated(1.0))
    hand = Plan(
        {
            "retriever": ComponentPlan("cpu", 1, 8, threads=2),
            "augmenter": ComponentPlan("gpu", 1, 4),  # virtual GPUs, so that the retriever may take 2 cores
            "generator": ComponentPlan("gpu", 1, 16),
        },
        throughput=0.0,
        bottleneck="augmenter",
    )
    with patchkit.deploy(pipeline, plan=hand) as endpoint:
        assert endpoint.query(query="x") == "x"
        placed = placement(endpoint)
    assert placed["retriever"] == [(available_cpus()[:2], "2")]


def test_a_cpu_replica_may_lend_1_2_or_4_shares_of_its_last_core() -> None:
    core = SHARES_PER_CORE
    for units, threads in ((core - 1, 1), (core - 2, 1), (2 * core - 1, 2), (2 * core - 4, 2)):
        assert ComponentPlan("cpu", 2, 4, units=units, threads=threads).units == units
    lending = ComponentPlan("cpu", 2, 4, units=core - 2)
    assert "1, 2/8 core lent" in Plan({"llm": lending}, 0.0, "llm").table()
    with pytest.raises(patchkit.InputError, match=f"or {core - 1} or {core - 2} \\(part of its last core lent\\)"):
        ComponentPlan("cpu", 1, 4, units=core - 3)  # 3 lent: not a size share replicas pack into
    with pytest.raises(patchkit.InputError, match="got units=4"):
        ComponentPlan("cpu", 1, 4, units=4, threads=2)


def test_a_hand_made_plan_deploys_inprocess_and_round_trips_through_json() -> None:
    pipeline = rag(Simulated(1.0))
    hand = Plan(
        {
            "retriever": ComponentPlan("cpu", 2, 8),
            "augmenter": ComponentPlan("cpu", 1, 4, units=SHARES_PER_CORE // 2),  # half a core
            "generator": ComponentPlan("gpu", 1, 16),
        },
        throughput=0.0,
        bottleneck="augmenter",
    )
    assert Plan.from_dict(json.loads(json.dumps(hand.to_dict()))) == hand
    assert f"1 on {SHARES_PER_CORE // 2}/{SHARES_PER_CORE} core" in hand.table() and hand.used() == {"cpu": 2.5, "gpu": 1}
    quarters = hand.to_dict()  # as a patchkit counting quarters of a core wrote it
    quarters["shares_per_core"] = 4
    quarters["components"]["retriever"]["units"], quarters["components"]["augmenter"]["units"] = 4, 2
    assert Plan.from_dict(quarters) == hand
    saved = hand.to_dict()  # as an older patchkit wrote it: no threads, a CPU replica's units its cores
    for c in saved["components"].values():
        del c["threads"]
        c["units"] = 1
    old = Plan.from_dict(saved)
    assert old.components["retriever"] == ComponentPlan("cpu", 2, 8, threads=1) and old.components["generator"].units == 1
    with patchkit.deploy(pipeline, plan=hand, backend="inprocess") as endpoint:
        assert endpoint.query(query="x") == "x"
        assert {n: len(c["replicas"]) for n, c in endpoint.stats()["components"].items()}["retriever"] == 2
    with pytest.raises(patchkit.ConfigError, match="either plan= or replicas="):
        patchkit.deploy(pipeline, plan=hand, replicas=2)
    with pytest.raises(patchkit.ConfigError, match="no entry for generator"):
        patchkit.deploy(pipeline, plan=Plan({n: c for n, c in hand.components.items() if n != "generator"}, 0.0, "augmenter"))


def test_patchkit_plan_prints_the_plan_from_the_shell(tmp_path: Path) -> None:
    script = tmp_path / "pipe.py"
    script.write_text(textwrap.dedent("""
        import patchkit
        from patchkit.components.testing import Simulated

        retriever, generator = Simulated(lambda b: 2.0 * b), Simulated(10.0, resource="gpu", max_batch=70)
        query = "q"
        with patchkit.capture() as pipeline:
            answer = generator.run(retriever.run(query))
    """))
    done = subprocess.run(
        [sys.executable, "-m", "patchkit.cli", "plan", str(script), "--resources", "cpu=2,gpu=1", "--json"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr
    made = json.loads(done.stdout)
    assert made["components"]["retriever"]["replicas"] == 2 and made["components"]["generator"]["resource"] == "gpu"
    table = subprocess.run(
        [sys.executable, "-m", "patchkit.cli", "plan", str(script), "--resources", "cpu=2,gpu=1"],
        capture_output=True, text=True, timeout=300,
    )
    assert "retriever *" in table.stdout and "gpu (virtual)" in table.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "patchkit.cli", "plan", str(script), "--resources", "tpu=2"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "the resource types are cpu, gpu" in bad.stderr


class Loads(patchkit.Component):
    """Loads a 'model' in setup() and frees it in teardown(), counting its setups in this process."""

    def setup(self) -> None:
        self.model = "weights"
        self.__dict__["setups"] = self.__dict__.get("setups", 0) + 1

    def teardown(self) -> None:
        del self.model

    @patchkit.make
    def run(self, x: int) -> int:
        return x + len(self.model)


def test_plan_releases_what_its_calibration_loaded_and_keeps_what_was_loaded_before() -> None:
    loaded_by_plan, loaded_before = Loads(), Loads()
    assert loaded_before.run(0) == 7  # set up by the user, before planning
    x = 1
    with patchkit.capture(run=False) as pipeline:
        y = loaded_by_plan.run(x)
        z = loaded_before.run(y)  # noqa: F841 - the pipeline's output
    patchkit.plan(pipeline, resources={"cpu": 2, "gpu": 0}, calibration=[{"x": 1}], progress=False)
    assert "model" not in loaded_by_plan.__dict__ and loaded_by_plan.setups == 1  # the calibration's copy is gone
    assert loaded_before.model == "weights" and loaded_before.setups == 1
    assert loaded_by_plan.run(2) == 9 and loaded_by_plan.setups == 2  # used here again: set up again
