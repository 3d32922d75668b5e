"""`patchkit serve FILE.py`: serves a script's pipeline until Ctrl-C, then leaves nothing running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from serving import start_serve

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(p) for p in (task / "children").read_text().split()]
    return found


def test_serve_answers_over_http_and_ctrl_c_stops_everything() -> None:
    server, url = start_serve(ROOT / "examples" / "figure9.py")
    try:
        assert server.stdout is not None
        workers = _children(server.pid)
        assert len(workers) == 5  # one per component of Figure 9
        request = urllib.request.Request(
            url + "/v1/query",
            data=json.dumps({"inputs": {"query": "Which Linux distro suits beginners best?"}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as reply:
            output = json.loads(reply.read())["output"]
        assert output.startswith("Q: Which Linux distro suits beginners best? | based on 1 document(s): Ubuntu")
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0
        assert "patchkit: stopped" in server.stdout.read()
        for pid in workers:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        server.stdout.close()


def test_serve_says_when_the_script_captures_nothing(tmp_path: Path) -> None:
    script = tmp_path / "empty.py"
    script.write_text("x = 1\n")
    done = subprocess.run([sys.executable, "-m", "patchkit.cli", "serve", str(script)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "ran no `with patchkit.capture():` block" in done.stderr
