"""A version is what the user edited, on the install users run, and an update never stalls the server.

Each test stands where a user stands: patchkit installed from a wheel into a virtualenv of its own, a script
edited between versions, a helper module edited under `patchkit serve --reload`, a 100 MB global, a plan made
again after a method became slower, a pipeline captured in `python -c` code.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from serving import ROOT, serve_cli

import patchkit
from patchkit import Component, make
from patchkit.orchestrator import process

# A script as a user writes one: deploy, edit the class (a prompt constant and the method), update.
EDITED_SCRIPT = '''\
import sys

import patchkit
from patchkit import Component, make


class Gen(Component):
    PROMPT = "v1: "

    @make
    def generate(self, text: str) -> str:
        return self.PROMPT + text


gen = Gen()
text = "hi"
with patchkit.capture() as pipeline:
    answer = gen.generate(text)

with patchkit.deploy(pipeline) as endpoint:
    print("patchkit from", patchkit.__file__, flush=True)
    print("first", endpoint.query(text="hi"), flush=True)


    class Gen(Component):
        PROMPT = "V2: "

        @make
        def generate(self, text: str) -> str:
            return (self.PROMPT + text).upper()


    gen = Gen()
    with patchkit.capture() as edited:
        answer = gen.generate(text)
    print("plain", edited(text="hi"), flush=True)
    endpoint.update(edited)
    print("updated", endpoint.query(text="hi"), flush=True)
'''


def _wheel_environment(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A virtualenv with patchkit installed from a wheel of this checkout's files (not editable), and the
    environment to run it in; the other packages it imports are this environment's, on its path after its own.
    The wheel is built from a copy, so that no build folder of an earlier build (or of the checkout) leaks in."""
    source = tmp_path / "source"
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        source.mkdir(exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    for folder in ("patchkit", "examples"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(source)], check=True, cwd=tmp_path, env=env)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    own = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True, env=env).stdout.strip()
    wheel = next(wheels.glob("patchkit_rag-*.whl"))
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   cwd=tmp_path, env=env)
    (Path(own) / "test-environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")  # after the install
    return python, env


@pytest.mark.slow
def test_an_update_serves_the_edit_with_patchkit_installed_from_a_wheel(tmp_path: Path) -> None:
    python, env = _wheel_environment(tmp_path)
    script = tmp_path / "app.py"
    script.write_text(EDITED_SCRIPT)
    done = subprocess.run([str(python), str(script)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines())
    installed = Path(lines["patchkit"].removeprefix("from "))
    assert installed.is_relative_to(tmp_path / "venv") and not installed.is_relative_to(ROOT)  # the wheel's copy
    assert (lines["first"], lines["plain"], lines["updated"]) == ("v1: hi", "V2: HI", "V2: HI")


APP = '''\
import patchkit
import prompts
from patchkit import Component, make


class Gen(Component):
    @make
    def generate(self, question: str) -> str:
        return prompts.fmt(question)


gen = Gen()
question = "what is a loop?"
with patchkit.capture() as pipeline:
    answer = gen.generate(question)
'''


@pytest.mark.slow
def test_serve_reload_watches_the_user_s_modules_and_names_the_file_and_component(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(APP)
    prompts = tmp_path / "prompts.py"
    prompts.write_text("def fmt(question):\n    return 'Q: ' + question\n")
    with serve_cli(tmp_path, "app.py", "--reload") as (_, url, log):
        assert _query(url, question="hi") == "Q: hi"
        time.sleep(1.1)  # a modification time of its own, whatever the file system's resolution
        prompts.write_text("def fmt(question):\n    return 'Question: ' + question.upper()\n")
        _wait_until(lambda: _query(url, question="hi") == "Question: HI", "the edit of prompts.py served", log)
        found = re.search(r"reloading app\.py \(prompts\.py changed\): gen changed: (.*)$", log.read_text(), re.M)
        assert found is not None and found.group(1) == "helper prompts.fmt", log.read_text()


def _query(url: str, **inputs: Any) -> Any:
    reply = httpx.post(url + "/v1/query", json={"inputs": inputs}, timeout=30)
    reply.raise_for_status()
    return reply.json()["output"]


def _wait_until(condition: Any, what: str, log: Path | None = None, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}" + (f"\n{log.read_text()}" if log else "")
        time.sleep(0.2)


class _Recorder(Component):
    """Records whether its version was computed on an event loop's thread (the front-end's answers there)."""

    seen: list[bool] = []

    def __init__(self, tag: str) -> None:
        self.tag = tag

    def version_files(self) -> list[str]:
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            on_loop = False
        _Recorder.seen.append(on_loop)
        return []

    @make
    def generate(self, text: str) -> str:
        return self.tag + text


def test_versions_are_computed_by_the_caller_never_on_the_front_end_s_loop() -> None:
    _Recorder.seen.clear()
    text = "x"
    with patchkit.capture() as first:
        answer = _Recorder("a").generate(text)
    with patchkit.deploy(first, backend="inprocess") as endpoint:
        with patchkit.capture() as second:
            answer = _Recorder("b").generate(text)
        endpoint.update(second)
        assert endpoint.query(text="1") == "b1" and answer
    assert _Recorder.seen and not any(_Recorder.seen)


@pytest.mark.slow
def test_a_frame_of_100_mb_reads_whole_in_place() -> None:
    """The bootstrap and update pipe reads a frame into one buffer, however the pipe splits it."""
    body = np.random.default_rng(0).bytes(100 << 20)
    read, write = os.pipe()

    def send() -> None:
        with os.fdopen(write, "wb") as stream:
            process._write_frame(stream, b"", body)

    sender = threading.Thread(target=send)
    sender.start()
    with os.fdopen(read, "rb", buffering=0) as stream:
        size = process._read_exactly(stream, 8)
        assert size is not None
        frame = process._read_exactly(stream, int.from_bytes(size, "big"))
        assert frame is not None and frame == body
        assert process._read_exactly(stream, 1) is None  # the end of the pipe: no frame
    sender.join()


def _benchmark() -> Any:
    """benchmarks/big_payloads.py, whose script of a 100 MB global the test below updates."""
    spec = importlib.util.spec_from_file_location("big_payloads", ROOT / "benchmarks" / "big_payloads.py")
    assert spec is not None and spec.loader is not None
    found = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))  # its own imports (provenance)
    try:
        spec.loader.exec_module(found)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return found


@pytest.mark.slow
def test_health_answers_while_an_update_with_a_100_mb_global_runs(tmp_path: Path) -> None:
    """Digests run in the caller, pickles and pipes off the front-end's loop: `/healthz` answers throughout."""
    import runpy

    def load(seed: int) -> tuple[patchkit.Pipeline, int]:
        script = tmp_path / f"lookup_{seed}.py"
        script.write_text(_benchmark().BIG_GLOBAL.format(seed=seed, size=100 << 20))
        made = runpy.run_path(str(script), run_name="lookup")
        return made["pipeline"], int(made["TABLE"][7])

    pipeline, expected = load(1)
    with patchkit.deploy(pipeline) as endpoint:
        assert endpoint.query(index=7) == expected
        edited, expected = load(2)
        waits: list[float] = []
        stop = threading.Event()

        def probe() -> None:
            with httpx.Client(base_url=endpoint.url, timeout=30) as client:
                while not stop.is_set():
                    start = time.perf_counter()
                    assert client.get("/healthz").status_code == 200
                    waits.append(time.perf_counter() - start)
                    time.sleep(0.01)

        prober = threading.Thread(target=probe)
        prober.start()
        try:
            endpoint.update(edited)
        finally:
            stop.set()
            prober.join()
        assert endpoint.query(index=7) == expected
    assert len(waits) > 10
    assert max(waits) < 0.5, f"the slowest /healthz took {max(waits) * 1000:.0f} ms"


C_PLAN = textwrap.dedent('''\
    import patchkit
    from patchkit import Component, make

    class Upper(Component):
        @make
        def upper(self, text: str) -> str:
            return text.upper()

    upper = Upper()
    text = "plan me"
    with patchkit.capture() as pipeline:
        shout = upper.upper(text)
    plan = patchkit.plan(pipeline, resources={"cpu": 1}, calibration=[{"text": "a"}, {"text": "b"}], progress=False)
    print(plan.components["upper"].replicas)
''')


@pytest.mark.slow
def test_a_pipeline_captured_in_python_c_code_plans(tmp_path: Path) -> None:
    env = {**os.environ, "PATCHKIT_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-c", C_PLAN], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) >= 1
