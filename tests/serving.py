"""Helpers the tests share to serve a pipeline: a Frontend on the inprocess backend, `patchkit
serve` in a subprocess, and a one-call generator pipeline deployed on workers."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

import patchkit
from patchkit.config import DeploymentConfig
from patchkit.config.backends import make_backend
from patchkit.serving.frontend import Frontend

ROOT = Path(__file__).resolve().parent.parent


def run_frontend(
    pipeline: patchkit.Pipeline | Mapping[str, patchkit.Pipeline],
    body: Callable[[Frontend], Awaitable[Any]],
    *,
    clock: Callable[[], float] = time.monotonic,
    **options: Any,
) -> Any:
    """Start a Frontend of `pipeline` (or several by name; on the inprocess backend unless `backend=` says
    otherwise), run `body(frontend)` on its loop, close it."""

    async def main() -> Any:
        config = DeploymentConfig.resolve(pipeline, **{"backend": "inprocess", **options})
        frontend = Frontend(pipeline, config, make_backend(config), clock=clock)
        await frontend.start()
        try:
            return await body(frontend)
        finally:
            await frontend.close()

    return asyncio.run(main())


def start_serve(script: Path) -> tuple[subprocess.Popen[str], str]:
    """`patchkit serve SCRIPT` on a free port; returns once it has printed the URL it serves at."""
    server = subprocess.Popen(
        [sys.executable, "-m", "patchkit.cli", "serve", str(script), "--port", "0"], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert server.stdout is not None
    pattern = re.compile(rf"serving {re.escape(script.name)} at (http://127\.0\.0\.1:\d+)")
    url = next((m.group(1) for line in server.stdout if (m := pattern.search(line))), None)
    if url is None:
        server.kill()
        server.wait()
        raise AssertionError("patchkit serve printed no URL")
    return server, url


@contextmanager
def serve_cli(cwd: Path, *arguments: str) -> Iterator[tuple[subprocess.Popen[str], str, Path]]:
    """`patchkit serve ARGUMENTS --port 0` in `cwd` (the tests' components importable): the process, the URL it
    printed and the file its log goes to; stopped with Ctrl-C afterwards, which must end it with status 0."""
    log = cwd / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    with log.open("w") as stderr:
        server = subprocess.Popen([sys.executable, "-m", "patchkit.cli", "serve", *arguments, "--port", "0"],
                                  stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=cwd, env=env)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        found = re.search(r"^patchkit: serving (.*) at (http://127\.0\.0\.1:\d+) \(Ctrl-C stops\)$", line)
        assert found is not None, f"patchkit serve printed {line!r}; its log:\n{log.read_text()}"
        yield server, found.group(2), log
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=60) == 0
        assert server.stdout.read() == "patchkit: stopped\n"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        if server.stdout is not None:
            server.stdout.close()


def ask_deployed_together(llm: patchkit.Component, questions: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Deploy `answer = llm.generate(question)` on workers, ask every question at once; the answers
    and the statistics of the generator's `generate` queue."""

    def answer(question: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return llm.generate(question)  # type: ignore[attr-defined, no-any-return]
        return pipeline

    answer("x")

    async def together(endpoint: patchkit.Endpoint) -> list[str]:
        return list(await asyncio.gather(*(endpoint.aquery(question=q) for q in questions)))

    with patchkit.deploy(patchkit.last_pipeline()) as endpoint:
        answers = asyncio.run(together(endpoint))
        stats = endpoint.stats()
    kind = type(llm).__name__
    return answers, next(c for c in stats["components"].values() if c["class"] == kind)["methods"]["generate"]


def metric(text: str, name: str, **labels: str) -> float:
    """The value of the one sample `name{labels}` (exactly those labels) in a `/metrics` scrape, parsed as
    Prometheus parses it; AssertionError when the scrape has no such sample."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"no sample {name}{labels} in the scrape")
