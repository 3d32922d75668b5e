"""The front-end and the workers log at the level the deploying process configured: with
`logging.basicConfig(level=logging.INFO)` in a user's script, the autoscaler's INFO decisions, logged
in the front-end process, and a component's INFO lines, logged in its workers, reach the script's
stderr; without it, only warnings do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = """
import logging, sys, time
import patchkit

class Loud(patchkit.Component):
    def setup(self):
        logging.getLogger("patchkit.loud").info("set up in a worker")

    @patchkit.make
    def run(self, x):
        return x

if sys.argv[1] != "-":
    logging.basicConfig(level=sys.argv[1])
a = Loud()
x = 1
with patchkit.capture(run=False) as pipeline:
    answer = a.run(x)
with patchkit.deploy(pipeline, replicas=2, min_replicas=1, scale_down_after_s=0.2, autoscale_interval_s=0.1) as endpoint:
    assert endpoint.query(x=3) == 3
    deadline = time.monotonic() + 60
    while len(endpoint.stats()["components"]["a"]["replicas"]) > 1:
        assert time.monotonic() < deadline, "no replica was retired"
        time.sleep(0.1)
print("retired")
"""


def _run(tmp_path: Path, level: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "scale_down.py"
    script.write_text(SCRIPT)
    return subprocess.run([sys.executable, str(script), level], capture_output=True, text=True, timeout=180)


def test_front_end_info_lines_reach_the_user_who_asked_for_them(tmp_path: Path) -> None:
    done = _run(tmp_path, "INFO")
    assert done.returncode == 0 and done.stdout.strip() == "retired", done.stderr
    decisions = [line for line in done.stderr.splitlines() if "scaled down a to 1 replicas" in line]
    assert len(decisions) == 1, done.stderr
    assert "INFO front-end patchkit.serving.scaling" in decisions[0]
    workers = [line for line in done.stderr.splitlines() if "set up in a worker" in line]
    assert len(workers) == 2 and all(" INFO worker " in line for line in workers), done.stderr


def test_without_logging_configured_the_front_end_keeps_to_warnings(tmp_path: Path) -> None:
    done = _run(tmp_path, "-")
    assert done.returncode == 0 and done.stdout.strip() == "retired", done.stderr
    assert "scaled down" not in done.stderr and " INFO " not in done.stderr, done.stderr
