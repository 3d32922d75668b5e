"""Liveness and readiness apart: `/healthz` answers 200 whenever the front-end process answers, `/readyz` only
while every worker is up.

`patchkit serve` as a load balancer or Kubernetes sees it: `/readyz` is 503 while the workers start (the
server already answers, and refuses queries with 503), 200 once they are up, 503 while a worker's restart
fails, 200 once one serves again, and 503 from SIGTERM on while the request in flight drains; `/healthz` is
200 throughout. On real worker processes (slow), with a component whose `setup()` and calls wait on files
the test creates and removes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from components import Slow
from test_deploy_local import _in_threads, _join, _wait_until

import patchkit

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    '''
    import time
    from pathlib import Path

    import patchkit
    from patchkit import Component, make


    class Gated(Component):
        """setup() waits while the file `hold` exists and raises while `broken` does; a call waits while `busy` does."""

        def __init__(self, folder: str) -> None:
            self.folder = Path(folder)

        def _wait_while(self, name: str) -> None:
            while (self.folder / name).exists():
                time.sleep(0.02)

        def setup(self) -> None:
            self._wait_while("hold")
            if (self.folder / "broken").exists():
                raise RuntimeError("the file broken says setup() fails")

        @make
        def echo(self, text: str) -> str:
            self._wait_while("busy")
            return text.upper()


    gated = Gated({folder!r})
    text = "hello"
    with patchkit.capture(run=False, output="answer") as pipeline:
        answer = gated.echo(text)
    '''
)


def _get(url: str) -> tuple[int, dict[str, Any], dict[str, str]]:
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:  # noqa: S310 - a local test server
            return reply.status, json.loads(reply.read()), dict(reply.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def _query(url: str, text: str) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url + "/v1/query", data=json.dumps({"inputs": {"text": text}}).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:  # noqa: S310 - a local test server
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _answers(url: str) -> bool:
    try:
        return _get(url + "/healthz")[0] == 200
    except OSError:  # not listening yet
        return False


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _worker_pid(url: str) -> int:
    [replica] = [r for r in _get(url + "/v1/stats")[1]["components"]["gated"]["replicas"] if r["state"] == "serving"]
    return int(replica["pid"])


@pytest.mark.slow
def test_readyz_through_start_a_failed_restart_and_drain_while_healthz_stays_200(tmp_path: Path) -> None:
    script = tmp_path / "app.py"
    script.write_text(SCRIPT.format(folder=str(tmp_path)))
    (tmp_path / "hold").touch()
    url = f"http://127.0.0.1:{_free_port()}"
    out, err = (tmp_path / "stdout").open("w"), (tmp_path / "stderr").open("w")
    server = subprocess.Popen([sys.executable, "-m", "patchkit.cli", "serve", str(script), "--port", url.rsplit(":", 1)[1]],
                              stdout=out, stderr=err, text=True, cwd=ROOT)
    try:
        # Starting: the process answers, its worker's setup() waits.
        _wait_until(lambda: _answers(url), "the server listened", 60)
        status, ready, _ = _get(url + "/readyz")
        assert (status, ready["status"]) == (503, "starting")
        status, reply = _query(url, "early")
        assert status == 503 and reply["error"]["type"] == "Starting"
        assert "GET /readyz" in reply["error"]["message"]
        assert _get(url + "/healthz")[0] == 200
        (tmp_path / "hold").unlink()
        _wait_until(lambda: _get(url + "/readyz")[0] == 200, "the worker was up", 60)
        assert _get(url + "/readyz")[1] == {"status": "ready", "reasons": [], "components": {},
                                            "pipelines": {"patchkit": {"status": "ready", "reasons": []}}}
        status, reply = _query(url, "up")
        assert (status, reply["output"]) == (200, "UP")

        # A failed restart: the worker dies, and its replacement's setup() raises until the file goes.
        (tmp_path / "broken").touch()
        os.kill(_worker_pid(url), signal.SIGKILL)
        _wait_until(lambda: "restarting a replica of gated failed" in (tmp_path / "stderr").read_text(),
                    "a restart failed", 60)
        status, ready, _ = _get(url + "/readyz")
        assert status == 503 and ready["status"] == "unready"
        assert ready["reasons"] == ["gated#0 is dead; another is starting in its place"]
        assert _get(url + "/healthz")[0] == 200
        (tmp_path / "broken").unlink()
        _wait_until(lambda: _get(url + "/readyz")[0] == 200, "a restart succeeded", 60)
        assert _query(url, "again")[1]["output"] == "AGAIN"

        # Draining: SIGTERM while a call is in flight; the server still answers until it has drained.
        (tmp_path / "busy").touch()
        threads, results = _in_threads(lambda i: _query(url, "last"), 1)
        _wait_until(lambda: _get(url + "/healthz")[1]["inflight"] == 1, "the last request was in flight")
        server.send_signal(signal.SIGTERM)
        _wait_until(lambda: _get(url + "/readyz")[1]["status"] == "draining", "/readyz said draining")
        assert _get(url + "/readyz")[0] == 503
        assert _get(url + "/healthz")[0] == 200
        status, reply = _query(url, "too late")
        assert status == 503 and "shutting down" in reply["error"]["message"]
        (tmp_path / "busy").unlink()
        _join(threads)
        status, reply = results[0]
        assert (status, reply["output"]) == (200, "LAST")
        assert server.wait(timeout=60) == 0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        out.close()
        err.close()


slow = Slow(seconds=0.01)


def test_readyz_answers_without_the_token_and_says_ready_on_the_inprocess_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATCHKIT_AUTH_TOKEN", "secret-token")

    def body(text: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return slow.echo(text)  # type: ignore[no-any-return]
        return pipeline

    body("x")
    with patchkit.deploy(patchkit.last_pipeline(), backend="inprocess") as endpoint:
        assert _get(endpoint.url + "/readyz")[:2] == (200, {"status": "ready", "reasons": [], "components": {},
                                                            "pipelines": {"patchkit": {"status": "ready", "reasons": []}}})
        status, health, _ = _get(endpoint.url + "/healthz")
        assert status == 200 and health["status"] == "ok" and health["workers"] == "ok"
