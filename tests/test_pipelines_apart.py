"""Pipelines fail apart: one whose component cannot start is failed, with its reason, while the others serve.

A deployment of two pipelines where one's component raises in `setup()` (or aborts its worker process, a crash
in native code) starts the other: it answers and its own readiness (`GET /v1/pipelines/{name}/readyz`) is 200,
while the failed one's is 503 naming why, its requests get 503 at once, and `/readyz`, 200 ("degraded"), names it.
A component two pipelines share fails both. `deploy()` and `patchkit serve` fail only where no pipeline can serve,
or with `fail_fast`. Each pipeline is ready on its own: one whose replica fails its health checks is "unready" while
the other stays ready, and a component whose replicas die and cannot be started again is failed in the end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving import ROOT, run_frontend, serve_cli

import patchkit
from patchkit import Component, make
from patchkit.config import DeploymentConfig
from patchkit.errors import ComponentError, ComponentFailed
from patchkit.orchestrator import supervisor
from patchkit.serving.frontend import Frontend
from patchkit.serving.readiness import Readiness, of_pipeline, of_pipelines


class Notes(Component):
    """A component that starts and answers."""

    @make
    def find(self, text: str) -> str:
        return f"notes on {text}"


class Broken(Component):
    """Its `setup()` raises, as when a model file is missing."""

    def setup(self) -> None:
        raise RuntimeError("the model file is missing")

    @make
    def answer(self, text: str) -> str:
        return text


class Aborts(Component):
    """Its `setup()` kills its worker process with SIGABRT, as a C extension crashing while it loads does."""

    def setup(self) -> None:
        os.abort()

    @make
    def answer(self, text: str) -> str:
        return text


class Moody(Component):
    """Fails its health checks while `unwell`."""

    unwell = False

    def check_health(self) -> None:
        if self.unwell:
            raise RuntimeError("the index went away")

    @make
    def echo(self, text: str) -> str:
        return text


class Gated(Component):
    """Its `setup()` raises while the file `broken` exists in `folder`."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def setup(self) -> None:
        if Path(self.folder, "broken").exists():
            raise RuntimeError("the file broken says setup() fails")

    @make
    def echo(self, text: str) -> str:
        return text.upper()


# Each pipeline names its component after the variable it calls, as its deployment does.
def _notes(notes: Notes) -> patchkit.Pipeline:
    text = "x"
    with patchkit.capture(run=False, output="answer") as pipeline:
        answer = notes.find(text)  # noqa: F841 - the block's output
    return pipeline


def _broken(broken: Broken) -> patchkit.Pipeline:
    text = "x"
    with patchkit.capture(run=False, output="answer") as pipeline:
        answer = broken.answer(text)  # noqa: F841 - the block's output
    return pipeline


def _both(notes: Notes, broken: Broken) -> patchkit.Pipeline:
    text = "x"
    with patchkit.capture(run=False, output="answer") as pipeline:
        answer = broken.answer(notes.find(text))  # noqa: F841 - the block's output
    return pipeline


def _aborts(aborts: Aborts) -> patchkit.Pipeline:
    text = "x"
    with patchkit.capture(run=False, output="answer") as pipeline:
        answer = aborts.answer(text)  # noqa: F841 - the block's output
    return pipeline


def _moody(moody: Moody) -> patchkit.Pipeline:
    text = "x"
    with patchkit.capture(run=False, output="answer") as pipeline:
        answer = moody.echo(text)  # noqa: F841 - the block's output
    return pipeline


def _gated(gated: Gated) -> patchkit.Pipeline:
    text = "x"
    with patchkit.capture(run=False, output="answer") as pipeline:
        answer = gated.echo(text)  # noqa: F841 - the block's output
    return pipeline


def _get(url: str) -> tuple[int, Any]:
    reply = httpx.get(url, timeout=30)
    return reply.status_code, reply.json()


# -- at deploy: the broken pipeline is failed, the other serves -----------------------------------------------------
def test_a_pipeline_whose_component_cannot_start_is_failed_and_the_other_serves(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATCHKIT_AUTH_TOKEN", "s3cret")
    pipelines = {"notes": _notes(Notes()), "broken": _broken(Broken())}
    with caplog.at_level(logging.WARNING, logger="patchkit"), patchkit.deploy(pipelines, backend="inprocess") as endpoint:
        [line] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "is failed" in r.getMessage()]
        assert line == ("pipeline broken is failed: its component broken could not start: ComponentError: broken.setup "
                        "raised: RuntimeError: the model file is missing; the others serve (notes)")
        assert endpoint["notes"].query(text="loops") == "notes on loops"

        # Its requests get a 503 at once, naming the pipeline and why.
        with pytest.raises(ComponentFailed, match=r"^pipeline broken cannot serve: broken is failed: it could not start: "
                                                  r"ComponentError: broken.setup raised: RuntimeError: the model file"):
            endpoint["broken"].query(text="loops")
        token = {"Authorization": "Bearer s3cret"}
        reply = httpx.post(endpoint.url + "/v1/pipelines/broken/query", json={"inputs": {"text": "a"}}, headers=token)
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "ComponentFailed"
        assert "pipeline broken cannot serve" in reply.json()["error"]["message"]

        rows = {row["name"]: row for row in endpoint.pipelines()}
        assert rows["notes"]["state"] == "ready" and "reason" not in rows["notes"]
        assert rows["broken"]["state"] == "failed" and "RuntimeError: the model file is missing" in rows["broken"]["reason"]

        # The probes, without the token: each pipeline's own, and the deployment's naming the failed one.
        assert _get(endpoint.url + "/v1/pipelines/notes/readyz") == (200, {"status": "ready", "reasons": []})
        failed = {"status": "failed", "reasons": ["broken is failed: it could not start (ComponentError)"]}
        assert _get(endpoint.url + "/v1/pipelines/broken/readyz") == (503, failed)
        status, ready = _get(endpoint.url + "/readyz")
        assert (status, ready["status"]) == (200, "degraded")
        assert ready["pipelines"] == {"notes": {"status": "ready", "reasons": []}, "broken": failed}
        assert ready["components"] == {"broken": failed} and ready["reasons"] == failed["reasons"]
        assert endpoint.readiness("broken") == failed and endpoint.readiness()["status"] == "degraded"
        status, unknown = _get(endpoint.url + "/v1/pipelines/nope/readyz")
        assert status == 404 and unknown["error"]["type"] == "PipelineNotFound" and "notes" in unknown["error"]["message"]
        assert "model file" not in str(ready)  # the probes ask no token: no error text


def test_a_component_two_pipelines_share_fails_both_and_the_third_serves() -> None:
    shared, notes = Broken(), Notes()
    pipelines = {"a": _both(notes, shared), "b": _broken(shared), "c": _notes(notes)}

    async def body(frontend: Frontend) -> None:
        states = {row["name"]: row["state"] for row in frontend.describe()}
        assert states == {"a": "failed", "b": "failed", "c": "ready"}
        assert [frontend.pipeline_readiness(name).status for name in "abc"] == ["failed", "failed", "ready"]
        assert frontend.readiness().status == "degraded" and frontend.readiness().ready
        assert (await frontend.query({"text": "x"}, pipeline="c")).output == "notes on x"
        with pytest.raises(ComponentFailed, match="^pipeline a cannot serve: broken is failed"):
            await frontend.query({"text": "x"}, pipeline="a")

    run_frontend(pipelines, body)


def test_deploy_raises_where_no_pipeline_can_serve_and_with_fail_fast() -> None:
    with pytest.raises(ComponentError, match="broken.setup raised: RuntimeError: the model file is missing"):
        patchkit.deploy({"one": _broken(Broken()), "two": _broken(Broken())}, backend="inprocess")
    pipelines = {"notes": _notes(Notes()), "broken": _broken(Broken())}
    with pytest.raises(ComponentError, match="broken.setup raised"):
        patchkit.deploy(pipelines, backend="inprocess", fail_fast=True)


# -- while serving: each pipeline is ready on its own ---------------------------------------------------------------
def test_a_replica_failing_its_checks_makes_only_its_own_pipeline_unready() -> None:
    moody = Moody()
    pipelines = {"sick": _moody(moody), "fine": _notes(Notes())}

    async def body(frontend: Frontend) -> None:
        assert frontend.readiness().status == "ready"
        moody.unwell = True
        while not frontend.deployment.supervisor.replicas("moody")[0].failed_checks:
            await asyncio.sleep(0.01)
        sick, fine = frontend.pipeline_readiness("sick"), frontend.pipeline_readiness("fine")
        assert sick.status == "unready" and sick.reasons[0].startswith("moody#0 failed its last ")
        assert fine.status == "ready" and fine.ready
        whole = frontend.readiness()
        assert whole.status == "unready" and not whole.ready  # a pipeline not failed is not ready: 503
        assert whole.to_json()["pipelines"]["fine"] == {"status": "ready", "reasons": []}
        assert whole.to_json()["components"]["moody"]["status"] == "unready"

    run_frontend(pipelines, body, health_check_period_s=0.02, health_check_failures=10_000)


def test_a_replica_replaced_beside_one_serving_keeps_its_pipeline_ready_and_a_restart_holds_the_endpoint() -> None:
    states = {"llm": ("degraded", ["llm#1 is dead; another is starting in its place"]),
              "index": ("unready", ["index#0 is dead; another is starting in its place"]),
              "broken": ("failed", ["broken is failed: it could not start (ComponentError)"])}
    assert of_pipeline({"llm"}, states) == Readiness("ready")  # llm#0 serves its calls
    restarting = of_pipeline({"llm", "index"}, states)
    assert restarting == Readiness("unready", ("index#0 is dead; another is starting in its place",))
    failed = of_pipeline({"broken", "llm"}, states)
    assert failed.status == "failed" and not failed.ready
    whole = of_pipelines({"chat": Readiness("ready"), "search": restarting, "bad": failed}, states, states)
    assert (whole.status, whole.ready) == ("unready", False)  # a pipeline not failed restarts: 503 until it ends
    assert whole.to_json()["components"]["llm"] == {"status": "degraded", "reasons": list(states["llm"][1])}
    assert of_pipelines({"chat": Readiness("ready"), "bad": failed}, states, states).status == "degraded"
    assert of_pipelines({"bad": failed}, states, states).status == "failed"


def test_a_component_whose_replica_dies_and_cannot_be_started_again_is_failed_in_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real worker processes, the supervisor in this process with no backoff between restarts."""
    monkeypatch.setattr(supervisor, "RESTART_BACKOFF_S", (0.0,))
    pipelines = {"gated": _gated(Gated(str(tmp_path))), "notes": _notes(Notes())}

    async def body(frontend: Frontend) -> None:
        [replica] = frontend.deployment.supervisor.replicas("gated")
        (tmp_path / "broken").touch()
        assert replica.pid is not None
        os.kill(replica.pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while frontend.pipeline_readiness("gated").status != "failed":
            assert time.monotonic() < deadline, "gated was not failed"
            await asyncio.sleep(0.05)
        assert frontend.pipeline_readiness("gated").reasons == ("gated is failed: its replicas died and could not be "
                                                                "started again",)
        assert frontend.readiness().status == "degraded"
        assert (await frontend.query({"text": "x"}, pipeline="notes")).output == "notes on x"
        with pytest.raises(ComponentFailed, match=f"gated is failed: its replicas died and {supervisor.RESTARTS_TO_FAIL} "
                                                  "restarts in a row could not start"):
            await frontend.query({"text": "x"}, pipeline="gated")

    run_frontend(pipelines, body, backend="local")


# -- real processes: a worker that aborts at setup(), and `patchkit serve` ---------------------------------------
def test_a_worker_aborting_in_setup_fails_its_pipeline_on_the_local_backend(capfd: pytest.CaptureFixture[str]) -> None:
    pipelines = {"notes": _notes(Notes()), "crash": _aborts(Aborts())}
    with patchkit.deploy(pipelines) as endpoint:
        assert endpoint["notes"].query(text="a") == "notes on a"
        failed = {"status": "failed", "reasons": ["aborts is failed: it could not start (WorkerDiedError)"]}
        assert endpoint.readiness("crash") == failed
        assert endpoint.readiness()["status"] == "degraded" and endpoint.readiness("notes")["status"] == "ready"
        with pytest.raises(ComponentFailed, match=r"pipeline crash cannot serve: aborts is failed: it could not start: "
                                                  r"WorkerDiedError: worker aborts#0 exited with code -6 before it was ready"):
            endpoint["crash"].query(text="a")
    logged = capfd.readouterr().err
    assert "WARNING" in logged and "pipeline crash is failed: its component aborts could not start: WorkerDiedError" in logged


NOTES = """\
import patchkit
from test_pipelines_apart import Notes

notes = Notes()
text = "x"
with patchkit.capture(run=False, output="answer") as pipeline:
    answer = notes.find(text)
"""

BROKEN = """\
import patchkit
from test_pipelines_apart import Broken

broken = Broken()
text = "x"
with patchkit.capture(run=False, output="answer") as pipeline:
    answer = broken.answer(text)
"""


def _serve_exits(cwd: Path, *arguments: str) -> tuple[int, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run([sys.executable, "-m", "patchkit.cli", "serve", *arguments, "--port", "0"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    return done.returncode, done.stderr


def test_patchkit_serve_keeps_serving_the_healthy_pipeline_and_exits_where_none_can(tmp_path: Path) -> None:
    (tmp_path / "notes.py").write_text(NOTES)
    (tmp_path / "broken.py").write_text(BROKEN)
    with serve_cli(tmp_path, "notes=notes.py", "broken=broken.py") as (_, url, log):
        reply = httpx.post(url + "/v1/pipelines/notes/query", json={"inputs": {"text": "sets"}}, timeout=30)
        assert reply.json()["output"] == "notes on sets"
        assert _get(url + "/v1/pipelines/broken/readyz")[0] == 503 and _get(url + "/readyz")[0] == 200
        assert "WARNING patchkit.serving.readiness: pipeline broken is failed: its component broken could not start: " \
               "ComponentError: broken.setup raised: RuntimeError: the model file is missing" in log.read_text()
    code, stderr = _serve_exits(tmp_path, "broken=broken.py")
    assert code == 2 and "patchkit serve: broken.setup raised: RuntimeError: the model file is missing" in stderr
    code, stderr = _serve_exits(tmp_path, "notes=notes.py", "broken=broken.py", "--fail-fast")
    assert code == 2 and "fail_fast is set: the deployment stops" in stderr


def test_fail_fast_is_a_config_file_key_and_a_flag_both_ways(tmp_path: Path) -> None:
    from patchkit.cli.commands import parser, serve_settings

    (tmp_path / "deploy.yaml").write_text(textwrap.dedent("fail_fast: true\n"))
    given = parser().parse_args(["serve", "a.py", "--config", str(tmp_path / "deploy.yaml")])
    assert serve_settings(given)["fail_fast"] is True
    overridden = parser().parse_args(["serve", "a.py", "--config", str(tmp_path / "deploy.yaml"), "--no-fail-fast"])
    assert serve_settings(overridden)["fail_fast"] is False
    assert "fail_fast" not in serve_settings(parser().parse_args(["serve", "a.py"]))
    config = DeploymentConfig.resolve(_notes(Notes()), fail_fast=True)
    assert config.liveness.fail_fast and config.describe()["fail_fast"] is True
