"""Pipelines in versions, and a steady load on an endpoint: for the tests of several pipelines and of updates."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import httpx

import patchkit
from patchkit import Component, make


class Tagger(Component):
    """Tags each text with its own tag and the process that ran it; a batch is logged whole to `log`."""

    def __init__(self, tag: str, log: str = "", delay_s: float = 0.0) -> None:
        self.tag, self.log, self.delay_s = tag, log, delay_s

    def setup(self) -> None:
        self.pid = os.getpid()

    @make(batch=True, max_batch_size=16, read_only=True)
    def mark(self, texts: list[str]) -> list[str]:
        if self.log:
            with open(self.log, "a") as log:
                log.write(json.dumps(texts) + "\n")
        time.sleep(self.delay_s)
        return [f"{text}|{self.tag}@{self.pid}" for text in texts]


class Refuses(Component):
    """A component whose setup fails once `flag` exists: captured before, a worker cannot start it after."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def setup(self) -> None:
        if Path(self.flag).exists():
            raise RuntimeError("the model file is missing")

    @make
    def mark(self, text: str) -> str:
        return text


def shout(tagger: Tagger, shared: Tagger, text: str = "hello") -> Any:
    with patchkit.capture():
        return shared.mark(tagger.mark(text)).upper()


def shout_pipeline(tagger: Tagger, shared: Tagger) -> patchkit.Pipeline:
    shout(tagger, shared)
    return patchkit.last_pipeline()


def whisper(tagger: Tagger, shared: Tagger, text: str = "hello") -> Any:
    with patchkit.capture():
        return shared.mark(tagger.mark(text)).lower()


def whisper_pipeline(tagger: Tagger, shared: Tagger) -> patchkit.Pipeline:
    whisper(tagger, shared)
    return patchkit.last_pipeline()


def refusing(broken: Refuses, shared: Tagger, text: str = "hello") -> Any:
    with patchkit.capture():
        return broken.mark(shared.mark(text))


def refusing_pipeline(shared: Tagger, flag: Path) -> patchkit.Pipeline:
    """Captured while its Refuses starts; a worker started after cannot start it."""
    refusing(Refuses(str(flag)), shared)
    flag.write_text("")
    return patchkit.last_pipeline()


def pids(answer: str) -> list[str]:
    """The processes that ran each component of an answer, in order."""
    return [part.rsplit("@", 1)[1] for part in answer.split("|")[1:]]


class Load:
    """Requests sent at a steady rate from several threads, each recorded with when it was sent and answered."""

    def __init__(self, url: str, rate: float = 40.0, threads: int = 8) -> None:
        self.url, self.period = url, threads / rate
        self.records: list[tuple[float, float, str | None, str]] = []  # sent, answered, output (None: failed), version
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._send, args=(i,)) for i in range(threads)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _send(self, index: int) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as client:
            n = 0
            while not self._stop.is_set():
                sent = time.monotonic()
                try:
                    reply = client.post("/v1/query", json={"inputs": {"text": f"Load{index}x{n}"}})
                    output = reply.json()["output"] if reply.status_code == 200 else None
                    self.records.append((sent, time.monotonic(), output, reply.headers.get("X-Pipeline-Version", "")))
                except httpx.HTTPError:
                    self.records.append((sent, time.monotonic(), None, ""))
                n += 1
                self._stop.wait(max(0.0, self.period - (time.monotonic() - sent)))


def update_under_load(endpoint: patchkit.Endpoint, seconds: float = 1.5) -> None:
    """Update `endpoint` (serving `shout_pipeline(Tagger("v1"), ...)`) to `whisper_pipeline(Tagger("v2"), ...)`
    under a steady load of at least 20 requests a second, and check what every request got: none failed, each
    answer wholly one version's, and none sent after `update()` returned answered by the old version."""
    probes: list[int] = []
    stop = threading.Event()

    def probe() -> None:  # a load balancer's readiness checks: the endpoint stays in rotation throughout
        while not stop.wait(0.05):
            probes.append(httpx.get(f"{endpoint.url}/readyz", timeout=10).status_code)

    prober = threading.Thread(target=probe)
    with Load(endpoint.url) as load:
        prober.start()
        time.sleep(seconds)
        endpoint.update(whisper_pipeline(Tagger("v2"), Tagger("shared")))
        switched = time.monotonic()
        time.sleep(seconds)
        stop.set()
        prober.join()
    assert probes and set(probes) == {200}, probes
    records = load.records
    assert len(records) / (2 * seconds) >= 20, f"{len(records)} requests in {2 * seconds:g} s"
    assert [r for r in records if r[2] is None] == []  # none failed
    for sent, _, output, version in records:
        assert output is not None
        old, new = output.startswith("LOAD") and "|V1@" in output, output.startswith("load") and "|v2@" in output
        assert old or new, output  # wholly one version: never v1's code with v2's component, or the reverse
        assert version.startswith("1-" if old else "2-")
        if sent > switched:
            assert new, f"sent {sent - switched:.3f} s after update() returned, answered by the old version: {output}"


def wait_for(condition: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the condition did not hold in time"
        time.sleep(0.1)




def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
