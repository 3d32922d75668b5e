"""`patchkit doctor`: what a bug report needs to know about this machine, and whether each part of patchkit
that runs native code works on it.

It prints the environment (`environment.py`: Python, OS, CPU model and flags, cores, memory, GPUs, the
versions of patchkit's dependencies and extras), then runs each check (`checks.py`: llama.cpp decodes with
the bundled model, FAISS searches, the embedder embeds, HiGHS and gurobipy solve a MILP, Ray starts, a
port binds) in a child process of its own (`runner.py`, `child.py`), one line each: ok, failed or skipped,
with the reason. A crash in native code is reported by the signal's name; the command exits 1 when any
check fails.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from patchkit.doctor.checks import CHECKS
from patchkit.doctor.environment import environment
from patchkit.doctor.runner import TIMEOUT_S, CheckResult, each_check, run_checks

__all__ = ["CHECKS", "TIMEOUT_S", "CheckResult", "environment", "print_report", "report", "run_checks", "to_json"]


def report(names: Sequence[str] | None = None, *, model: str | None = None, timeout_s: float = TIMEOUT_S,
           crash: Sequence[str] = ()) -> dict[str, Any]:
    """The environment and the checks' results, as `patchkit doctor --json` prints them; `ok` is whether
    no check failed."""
    results = run_checks(names, model=model, timeout_s=timeout_s, crash=crash)
    return {"environment": environment(), "checks": [r.to_dict() for r in results],
            "ok": all(r.status != "failed" for r in results)}


def print_report(names: Sequence[str] | None = None, *, model: str | None = None, timeout_s: float = TIMEOUT_S,
                 crash: Sequence[str] = (), out: TextIO | None = None) -> bool:
    """`patchkit doctor` without --json: the environment, then each check's line as the check ends, then
    a summary, on `out` (stdout). Returns whether no check failed."""
    def say(line: str) -> None:
        print(line, file=out or sys.stdout, flush=True)

    say("Environment")
    for key, value in _environment_lines(environment()):
        say(f"  {key:<10} {value}")
    say("\nChecks")
    width = max(len(c.name) for c in CHECKS)
    results = []
    for result in each_check(names, model=model, timeout_s=timeout_s, crash=crash):
        took = f" ({result.seconds:.1f} s)" if result.status != "skipped" else ""
        say(f"  {result.status:<8} {result.name:<{width}}  {result.detail}{took}")
        results.append(result)
    failed = [r.name for r in results if r.status == "failed"]
    skipped = sum(r.status == "skipped" for r in results)
    say(f"\n{len(failed)} of {len(results)} checks failed: {', '.join(failed)}" if failed
        else f"\nno check failed ({len(results) - skipped} ok, {skipped} skipped)")
    return not failed


def _environment_lines(env: Mapping[str, Any]) -> list[tuple[str, str]]:
    python, cpu, memory, kit = env["python"], env["cpu"], env["memory"], env["patchkit"]
    installed = (f"{kit['version']} (distribution {kit['distribution']})" if kit["distribution"]
                 else "not installed as a distribution")
    amx = "yes" if cpu["amx"] else "no"
    return [
        ("patchkit", f"{installed}, from {kit['path']}"),
        ("python", f"{python['version']} ({python['implementation']}, {python['executable']})"),
        ("os", env["os"]),
        ("cpu", f"{cpu['model']}; {cpu['cores']} cores, {cpu['usable_cores']} usable"),
        ("cpu flags", f"{' '.join(cpu['flags']) or 'none of ' + ' '.join(cpu['missing'])}; AMX: {amx}"
                      + (f"; not present: {' '.join(cpu['missing'])}" if cpu["flags"] and cpu["missing"] else "")
                      + (f" (from {cpu['flags_from']})" if cpu["flags_from"] != "/proc/cpuinfo" else "")),
        ("memory", f"{memory['total_gib']} GiB, {memory['available_gib']} GiB available"),
        ("gpus", _gpus(env["gpus"])),
        ("requires", _versions(kit["requires"])),
        *((f"[{extra}]", _versions(packages)) for extra, packages in kit["extras"].items()),
    ]


def _gpus(found: Mapping[str, Any]) -> str:
    """The GPUs nvidia-smi lists, else those torch sees, else "none"; then what torch says of CUDA."""
    torch = found["torch"]
    devices = "; ".join(found["nvidia_smi"].splitlines()) if found["nvidia_smi"] else ""
    if not devices and torch is not None and torch.get("devices"):
        devices = ", ".join(torch["devices"])
    if torch is None:
        return devices or "none"
    if "error" in torch:
        return f"{devices or 'none'} (torch: {torch['error']})"
    cuda = f"CUDA {torch['cuda']}" if torch["cuda"] else "a CPU-only build"
    return f"{devices or 'none'} (torch {torch['torch']}, {cuda}, sees {len(torch['devices'])} CUDA devices)"


def _versions(packages: Mapping[str, str | None]) -> str:
    return ", ".join(f"{name} {version or '(not installed)'}" for name, version in packages.items()) or "-"


def to_json(made: Mapping[str, Any]) -> str:
    """`report()` as one JSON object."""
    return json.dumps(made, indent=2)
