"""Components for the tests of what crosses between the front-end and its workers, and of liveness:
arguments and replies that do not pickle, calls that hang, health checks, retries, subprocesses."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from patchkit import Component, make


def argument(text: str) -> Any:
    """Pipeline code's own value for a call: one that does not pickle for the text "unpicklable"."""
    return threading.Lock() if text == "unpicklable" else text


def _refuse() -> None:
    raise ValueError("this reply cannot be read here")


class Unreadable:
    """Pickles on the worker, but unpickling it anywhere fails."""

    def __reduce__(self) -> Any:
        return (_refuse, ())


class Replier(Component):
    @make
    def reply(self, text: str) -> Any:
        return Unreadable() if text == "unreadable" else text.upper()


class Sleeper(Component):
    """Sleeps as long as it is asked: long enough, it hangs."""

    @make(timeout_s=1, retries=0)
    def wait(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


class Checked(Component):
    """Fails its health checks while the file `flag` exists."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def check_health(self) -> None:
        if Path(self.flag).exists():
            raise RuntimeError(f"{self.flag} says I am unwell")

    @make
    def echo(self, text: str) -> str:
        return text.upper()


class Journal(Component):
    """Writes a line to `path` as each call starts, then takes `seconds`: counts how often a call ran."""

    def __init__(self, path: str, seconds: float = 3.0) -> None:
        self.path = path
        self.seconds = seconds

    def _run(self, text: str) -> str:
        with open(self.path, "a") as journal:
            journal.write(text + "\n")
        time.sleep(self.seconds)
        return text.upper()

    @make(retries=0)
    def once(self, text: str) -> str:
        return self._run(text)

    @make
    def again(self, text: str) -> str:
        return self._run(text)


class Spawner(Component):
    """Starts a subprocess in setup(), as a component wrapping a server does; writes its pid to `pid_file`."""

    def __init__(self, pid_file: str) -> None:
        self.pid_file = pid_file

    def setup(self) -> None:
        self.child = subprocess.Popen(["sleep", "600"])  # noqa: S607 - a test's stand-in for a model server
        Path(self.pid_file).write_text(f"{self.child.pid}\n{os.getpid()}")

    @make
    def echo(self, text: str) -> str:
        return text.upper()


class Ledger(Component):
    """Writes "text pid" to `path` as each call starts, then sleeps `seconds`: which worker ran which call."""

    def __init__(self, path: str) -> None:
        self.path = path

    @make(retries=0)
    def run(self, text: str, seconds: float) -> str:
        with open(self.path, "a") as ledger:
            ledger.write(f"{text} {os.getpid()}\n")
        time.sleep(seconds)
        return text.upper()
