"""Updates keep what the user set, and change nothing until they are whole.

A component's options given at deploy (replicas, batch sizes, its autoscaling bounds) hold for its new versions
however many updates come; the update channel to the front-end process tells a late answer from the next one;
`/readyz` stays 200 through updates; a step that fails after the new components started stops them; a retired
version leaves the metrics' label sets.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import pickle
import re
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import httpx
import psutil
import pytest
from versions import Tagger, shout_pipeline, wait_for, whisper_pipeline

import patchkit
from patchkit import Component, make
from patchkit.config import DeploymentConfig
from patchkit.errors import PatchkitError, WorkerDiedError
from patchkit.orchestrator.process import Child, Message, spawn
from patchkit.server import process as server_process
from patchkit.server.process import FrontendServer
from patchkit.serving.frontend import Frontend


def _tagger(stats: dict[str, object]) -> str:
    """The deployed name of the pipeline's own tagger (its name changes with its versions: tagger, tagger@v2...)."""
    names = [name for name in stats["components"] if name != "shared"]  # type: ignore[union-attr]
    assert len(names) == 1, names
    return names[0]


def test_sizes_set_at_deploy_hold_through_three_updates() -> None:
    shared = Tagger("shared")
    with patchkit.deploy(shout_pipeline(Tagger("v1"), shared), replicas={"tagger": 3}, batch_size={"tagger": 4},
                         max_replicas={"tagger": 3}) as endpoint:
        for number, make in [(2, whisper_pipeline), (3, shout_pipeline), (4, whisper_pipeline)]:
            endpoint.update(make(Tagger(f"v{number}"), Tagger("shared")))
            wait_for(lambda: len(endpoint.stats()["components"]) == 2)  # the version before has stopped
            stats = endpoint.stats()
            name = _tagger(stats)
            tagger = stats["components"][name]
            assert len(tagger["replicas"]) == 3, (number, name, tagger["replicas"])
            assert tagger["methods"]["mark"]["batch_size"] == 4, (number, name)
            plan = endpoint.plan()
            assert plan["components"][name]["replicas"] == 3
            assert plan["max_replicas"] == {name: 3}  # the bound by name follows the component too
        assert endpoint.query(text="Four").startswith("four|v4@")


def _answerer() -> Child:
    env = {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    boot = pickle.dumps(types.SimpleNamespace(sys_path=[]))
    return spawn("answerer", boot, what="the answerer", env=env, timeout_s=60, messages=True)


def _message(text: str, wait_s: float = 0.0, stubborn: bool = False) -> bytes:
    return json.dumps({"text": text, "wait_s": wait_s, "stubborn": stubborn}).encode()


def test_an_answer_that_comes_late_is_never_read_as_the_next_one(caplog: pytest.LogCaptureFixture) -> None:
    child = _answerer()
    try:
        assert child.ask(_message("first"), 30)["echo"] == "first"
        # Not answered in time: withdrawn, and the child gives it up: nothing was applied, and it says so.
        with pytest.raises(PatchkitError, match="withdrawn, and nothing it asked for was applied"):
            child.ask(_message("slow", wait_s=2.0), 0.3)
        assert child.ask(_message("after the slow one"), 30)["echo"] == "after the slow one"
        # A child that applies it anyway, too late even for the withdrawal: unknown, and said so.
        with pytest.raises(WorkerDiedError, match="whether it was applied is not known"):
            child.ask(_message("stubborn", wait_s=1.0, stubborn=True), 0.2, withdraw_timeout_s=0.2)
        # Its answer comes while the next message waits for its own: discarded, logged, never returned.
        with caplog.at_level("WARNING", logger="patchkit.orchestrator.process"):
            assert child.ask(_message("next", wait_s=1.5), 30)["echo"] == "next"
        assert "discarded a late answer" in caplog.text and "stubborn" in caplog.text
    finally:
        child.stop(5)


@pytest.mark.slow
def test_readyz_stays_ready_through_ten_updates() -> None:
    shared = Tagger("shared")
    with patchkit.deploy(shout_pipeline(Tagger("v1"), shared), replicas={"tagger": 2}) as endpoint:
        answers: list[tuple[int, str]] = []
        stop = threading.Event()

        def probe() -> None:  # a load balancer's readiness checks, as fast as they come back
            with httpx.Client(base_url=endpoint.url, timeout=10) as client:
                while not stop.is_set():
                    reply = client.get("/readyz")
                    answers.append((reply.status_code, reply.text))

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            for number in range(2, 12):
                make = whisper_pipeline if number % 2 else shout_pipeline
                endpoint.update(make(Tagger(f"v{number}"), Tagger("shared")))
                endpoint.query(text="x")
            wait_for(lambda: len(endpoint.stats()["components"]) == 2)  # the last retired version has stopped
        finally:
            stop.set()
            prober.join()
        assert len(answers) > 100
        assert [a for a in answers if a[0] != 200] == []


class SlowStart(Component):
    """Takes `delay_s` to set up: an update that starts it outlasts the patience of whoever asked for it."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def setup(self) -> None:
        time.sleep(self.delay_s)

    @make
    def mark(self, text: str) -> str:
        return f"{text}|slow"


def slow(component: SlowStart, text: str = "hello") -> Any:
    with patchkit.capture(run=False):
        return component.mark(text)


@pytest.fixture
def frontend_server() -> Iterator[tuple[FrontendServer, asyncio.AbstractEventLoop]]:
    """The front-end process's server, on a loop of its own thread, serving shout (local backend)."""
    pipeline = shout_pipeline(Tagger("v1"), Tagger("shared"))
    server = FrontendServer(pipeline, DeploymentConfig.resolve(pipeline, backend="local"))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(server.start(), loop).result(120)
        yield server, loop
    finally:
        asyncio.run_coroutine_threadsafe(server.close(), loop).result(120)
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def test_a_withdrawn_update_is_cancelled_whole(frontend_server: tuple[FrontendServer, asyncio.AbstractEventLoop]) -> None:
    server, loop = frontend_server
    before = _workers()
    slow(SlowStart(3.0))
    message = Message(1, cloudpickle.dumps({"pipelines": {"patchkit": patchkit.last_pipeline()}, "remove": []}))
    threading.Timer(1.0, message.withdraw).start()  # while its worker starts: the asker gave up
    with pytest.raises(concurrent.futures.CancelledError):  # answered "withdrawn": nothing applied
        server_process._update(server, loop, message)
    frontend = server.frontend
    assert sorted(frontend.deployment.components) == ["shared", "tagger"]
    assert [v.number for v in frontend.versions.values()] == [1]
    # The worker that was starting when the update was withdrawn was stopped once up, not left behind.
    assert sorted(r.component for r in frontend.deployment.supervisor.backend.replicas()) == ["shared", "tagger"]
    time.sleep(4.0)  # past the slow setup: a worker whose start went on unwatched would be up by now
    assert _workers() == before
    result = asyncio.run_coroutine_threadsafe(frontend.query({"text": "still"}), loop).result(30)
    assert result.output.startswith("STILL|V1@")


def _workers() -> list[int]:
    """The worker processes this process started (directly or through a thread), still running."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "patchkit.orchestrator.worker" in child.cmdline() and child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
        except psutil.Error:
            continue
    return sorted(found)


def test_a_step_failing_after_the_new_components_started_rolls_the_update_back(monkeypatch: pytest.MonkeyPatch) -> None:
    shared = Tagger("shared")
    with patchkit.deploy(shout_pipeline(Tagger("v1"), shared), backend="inprocess") as endpoint:
        before = {r["id"] for c in endpoint.stats()["components"].values() for r in c["replicas"]}
        started: list[list[str]] = []

        def failing(self: Frontend, name: str, pipeline: patchkit.Pipeline, number: int) -> object:
            started.append(sorted(self.deployment.components))  # tagger@v2 is up: this step comes after its start
            raise RuntimeError("this step fails")

        monkeypatch.setattr(Frontend, "_version", failing)
        with pytest.raises(RuntimeError, match="this step fails"):
            endpoint.update(shout_pipeline(Tagger("v2"), Tagger("shared")))
        monkeypatch.undo()
        assert started == [["shared", "tagger", "tagger@v2"]]
        assert endpoint.query(text="still").startswith("STILL|V1@")
        assert [(r["version"], r["state"]) for r in endpoint.pipelines()] == [(1, "ready")]
        stats = endpoint.stats()
        assert sorted(stats["components"]) == ["shared", "tagger"]  # tagger@v2 stopped, its config dropped
        assert {r["id"] for c in stats["components"].values() for r in c["replicas"]} == before
        assert "tagger@v2" not in endpoint.plan()["components"]


def _series(text: str) -> list[str]:
    return [line.split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")]


def test_retired_versions_leave_the_metrics() -> None:
    shared = Tagger("shared")
    with patchkit.deploy(shout_pipeline(Tagger("v1"), shared)) as endpoint:
        endpoint.query(text="x")
        counts = []
        for number in range(2, 10):
            make = whisper_pipeline if number % 2 else shout_pipeline
            endpoint.update(make(Tagger(f"v{number}"), Tagger("shared")))
            endpoint.query(text="x")
            wait_for(lambda: len(endpoint.stats()["components"]) == 2 and
                     [r["state"] for r in endpoint.pipelines()] == ["ready"])
            metrics = httpx.get(f"{endpoint.url}/metrics", timeout=10).text
            counts.append(len(_series(metrics)))
        assert len(set(counts)) == 1, counts  # as many series with the 9th version as with the 2nd
        served = endpoint.pipelines()[0]
        versions = set(re.findall(r'patchkit_pipeline_requests_total\{[^}]*version="([^"]*)"', metrics))
        assert versions == {"retired", f"9-{served['digest']}"}
        retired = re.search(r'patchkit_pipeline_requests_total\{outcome="ok",pipeline="patchkit",version="retired"\} (\S+)',
                            metrics)
        assert retired is not None and float(retired.group(1)) == 8  # one request on each of v1..v8: none lost
