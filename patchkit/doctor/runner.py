"""Running `patchkit doctor`'s checks: each in a child process with a timeout, so that a crash is reported
(a signal by its name, with the Python frame it hit) and never suffered; a check whose extra is not
installed is skipped, naming the command that installs it.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib.util import find_spec

from patchkit.crashes import killed_by
from patchkit.doctor.checks import CHECKS, Check
from patchkit.doctor.environment import install_hint

__all__ = ["CheckResult", "each_check", "run_check", "run_checks", "signal_detail", "skip_reason"]

TIMEOUT_S = 300.0  # a check's time: loading a model of several GB from a slow disk included
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')


@dataclass(frozen=True)
class CheckResult:
    """How one check went: "ok", "failed" or "skipped", one line saying why, and its seconds."""

    name: str
    status: str
    detail: str
    seconds: float

    def to_dict(self) -> dict[str, object]:
        """As `patchkit doctor --json` lists it."""
        return asdict(self)


def skip_reason(check: Check) -> str | None:
    """Why `check` cannot run here (a module of its extra is missing), or None where it can."""
    for module in check.modules:
        try:
            missing = find_spec(module) is None
        except (ImportError, ValueError):  # a parent package that fails, or a module set to None
            missing = True
        if missing:
            return f"not installed (no module {module}): {install_hint(check.extra or '')}"
    return None


def signal_detail(number: int, stderr: str) -> str:
    """A child killed by signal `number`, in words: the signal's name, what it means, and the innermost
    Python frame faulthandler wrote on `stderr` ("SIGSEGV in native code, under llama_cpp/_internals.py:312
    in decode")."""
    words = killed_by(number)
    frame = _FRAME.search(stderr)
    if frame is None:
        return words
    path = frame["file"].replace(os.sep, "/")
    short = path.split("site-packages/", 1)[-1] if "site-packages/" in path else "/".join(path.split("/")[-2:])
    return f"{words}, under {short}:{frame['line']} in {frame['function']}"


def _failure(returncode: int, stderr: str) -> str:
    if returncode < 0:
        return signal_detail(-returncode, stderr)
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    return last if returncode == 1 and last else f"exited with status {returncode}" + (f": {last}" if last else "")


def run_check(check: Check, *, model: str | None = None, timeout_s: float = TIMEOUT_S, crash: bool = False) -> CheckResult:
    """Run `check` in a child process (`python -m patchkit.doctor.child`) and say how it went; called by
    `patchkit doctor` for every check it runs. The child leads a process group of its own, stopped whole
    when it ends or times out, so nothing it started (Ray's processes) outlives it. `crash`: the child kills
    itself with SIGSEGV instead (for patchkit's tests)."""
    reason = skip_reason(check)
    if reason is not None:
        return CheckResult(check.name, "skipped", reason, 0.0)
    command = [sys.executable, "-m", "patchkit.doctor.child", check.name]
    command += ["--model", model] if model is not None and check.name == "llama" else []
    command += ["--crash"] if crash else []
    started = time.perf_counter()
    # Files, not pipes: a process the check leaves behind that holds them open cannot make the wait hang.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, start_new_session=True)  # noqa: S603
        try:
            returncode: int | None = child.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:  # Ctrl-C included: the child's session does not get the terminal's SIGINT
            _stop_group(child)
        seconds = round(time.perf_counter() - started, 2)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if returncode is None:
        return CheckResult(check.name, "failed", f"timed out after {timeout_s:g} s (stopped)", seconds)
    if returncode != 0:
        return CheckResult(check.name, "failed", _failure(returncode, stderr), seconds)
    import json

    try:
        detail = json.loads(stdout.strip().splitlines()[-1])["detail"]
    except (ValueError, IndexError, KeyError, TypeError):
        return CheckResult(check.name, "failed", f"the check printed no result (stdout: {stdout.strip()[-200:]!r})", seconds)
    return CheckResult(check.name, "ok", str(detail), seconds)


def _stop_group(child: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is gone already
    child.wait()


def each_check(names: Sequence[str] | None = None, *, model: str | None = None, timeout_s: float = TIMEOUT_S,
               crash: Sequence[str] = ()) -> Iterator[CheckResult]:
    """Run the checks named (all of them, in their order, when None), one after another, yielding each
    result as it comes (the text report prints each line as its check ends)."""
    for check in CHECKS:
        if names is None or check.name in names:
            yield run_check(check, model=model, timeout_s=timeout_s, crash=check.name in crash)


def run_checks(names: Sequence[str] | None = None, *, model: str | None = None, timeout_s: float = TIMEOUT_S,
               crash: Sequence[str] = ()) -> list[CheckResult]:
    """Every result of `each_check`."""
    return list(each_check(names, model=model, timeout_s=timeout_s, crash=crash))
