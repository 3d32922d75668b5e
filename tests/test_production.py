"""What docs/production.md and the repository's Dockerfile tell an operator, kept true.

The Dockerfile installs extras that exist and every path the package is built from, and runs `patchkit
serve` on a pipeline that loads, with flags the CLI takes; the Kubernetes manifest and the systemd unit of
docs/production.md probe the right routes and give the drain its time. The image's build needs a Docker
daemon: where `docker info` does not answer (these test machines have none), that test is skipped with
the reason.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from patchkit.cli import parser
from patchkit.cli.targets import load_pipeline
from patchkit.config.groups import LivenessConfig
from patchkit.program.pipeline import Pipeline

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "Dockerfile").read_text()
PAGE = (ROOT / "docs" / "production.md").read_text()


def _instructions(name: str) -> list[str]:
    """The arguments of every `name` instruction of the Dockerfile, in order."""
    return [m.group(1).strip() for m in re.finditer(rf"^{name}\s+(.+)$", DOCKERFILE, re.MULTILINE)]


def _exec_form(name: str) -> list[str]:
    [last] = _instructions(name)[-1:]
    form: list[str] = json.loads(last)
    return form


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", PAGE, re.MULTILINE | re.DOTALL)


def _drain_timeout_s() -> float:
    return float(LivenessConfig().drain_timeout_s)


def test_the_dockerfile_installs_extras_that_exist_and_serves_a_pipeline_that_loads() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    extras = {arg.split("=", 1)[1] for arg in _instructions("ARG") if arg.startswith("EXTRAS=")}
    assert extras == {"retrieval,llm,sched"}
    assert set(extras.pop().split(",")) <= set(project["project"]["optional-dependencies"])
    copied = {path for line in _instructions("COPY") if "--from" not in line for path in line.split()[:-1]}
    sources = project["tool"]["setuptools"]["package-dir"].values()  # examples/, installed as patchkit.examples
    assert {"pyproject.toml", project["project"]["readme"], "patchkit", *sources} <= copied
    assert _exec_form("ENTRYPOINT") == ["patchkit", "serve"]
    command = _exec_form("CMD")
    args = parser().parse_args(["serve", *command])
    assert (args.host, args.port) == ("0.0.0.0", 8000)  # reachable from outside the container
    [target] = args.targets
    assert isinstance(load_pipeline(target), Pipeline)  # the default target loads (nothing runs: run=False)
    assert _instructions("STOPSIGNAL") == ["SIGTERM"]  # what the front-end drains on


def test_the_kubernetes_manifest_probes_healthz_and_readyz_and_outlasts_the_drain() -> None:
    [manifest] = [block for block in _blocks("yaml") if "kind: Deployment" in block]
    deployment = next(doc for doc in yaml.safe_load_all(manifest) if doc["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert pod["terminationGracePeriodSeconds"] > _drain_timeout_s()
    args = parser().parse_args(["serve", *container["args"]])
    assert args.host == "0.0.0.0" and args.port == container["ports"][0]["containerPort"]
    assert not any(env.get("value") for env in container["env"] if env["name"] == "PATCHKIT_AUTH_TOKEN")  # from a Secret


def test_the_systemd_unit_stops_the_front_end_alone_and_outlasts_the_drain() -> None:
    [unit] = _blocks("ini")
    settings = dict(re.findall(r"^(\w+)=([^#\n]*?)\s*(?:#.*)?$", unit, re.MULTILINE))
    assert settings["KillSignal"] == "SIGTERM" and settings["KillMode"] == "mixed"
    assert float(settings["TimeoutStopSec"]) > _drain_timeout_s()
    executable, *argv = shlex.split(settings["ExecStart"])
    assert executable.endswith("/patchkit")
    args = parser().parse_args(argv)
    assert args.command == "serve" and args.host == "127.0.0.1"  # behind the TLS proxy, on this machine only


def _docker_daemon() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode == 0


def _status(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:  # noqa: S310 - the container's own port
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:
        return 0, None


@pytest.mark.slow
@pytest.mark.skipif(not _docker_daemon(), reason="no Docker daemon answers `docker info` here: the image is built "
                    "where one does")
def test_the_image_builds_serves_and_drains_on_docker_stop() -> None:
    subprocess.run(["docker", "build", "-t", "patchkit-test", str(ROOT)], check=True, timeout=3600)
    container = subprocess.run(["docker", "run", "-d", "-p", "127.0.0.1:18000:8000", "patchkit-test"], check=True,
                               capture_output=True, text=True).stdout.strip()
    try:
        url = "http://127.0.0.1:18000"
        deadline = time.monotonic() + 900  # the workers load the models and embed the corpus first
        while _status(url + "/readyz")[0] != 200:
            assert time.monotonic() < deadline, "the container's workers never came up"
            assert _status(url + "/healthz")[0] in (0, 200)  # not listening yet, or alive
            time.sleep(2)
        subprocess.run(["docker", "stop", "-t", "45", container], check=True, timeout=120)
        state = subprocess.run(["docker", "inspect", "-f", "{{.State.ExitCode}}", container], check=True,
                               capture_output=True, text=True).stdout.strip()
        assert state == "0"  # drained and stopped its workers itself, before the grace ran out
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True)
