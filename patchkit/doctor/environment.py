"""What a bug report needs to know about this machine and this install: Python, the OS, the CPU (its model
and the flags native code picks its kernels by), cores, memory, GPUs, and the versions of patchkit's
dependencies and of each extra's packages, read from the installed distribution's metadata.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from patchkit import cpu, envs

__all__ = ["DISTRIBUTION", "checkout", "distribution", "environment", "install_hint", "packages"]

DISTRIBUTION = "patchkit-rag"  # the name pyproject.toml installs patchkit under (`patchkit` on PyPI is another project)
PROBE_TIMEOUT_S = 60
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_TORCH_PROBE = """import json, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(json.dumps({"torch": torch.__version__, "cuda": torch.version.cuda,
                  "devices": [torch.cuda.get_device_name(i) for i in range(n)]}))"""


def distribution() -> importlib.metadata.Distribution | None:
    """The installed distribution patchkit came from: `patchkit-rag`, or whichever one ships the `patchkit`
    package (an install made before the name changed); None where patchkit runs from a path, uninstalled."""
    try:
        return importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        pass
    for name in importlib.metadata.packages_distributions().get("patchkit", []) + ["patchkit"]:
        try:
            found = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if any(_requirement_name(r) == "bytecode" for r in found.requires or []):  # ours, not PyPI's `patchkit`
            return found
    return None


def checkout() -> Path | None:
    """The directory patchkit was installed from (`pip install -e DIR` records it), where that is known."""
    found = distribution()
    text = found.read_text("direct_url.json") if found is not None else None
    if not text:
        return None
    url = json.loads(text).get("url", "")
    return Path(unquote(urlparse(url).path)) if url.startswith("file://") else None


def install_hint(extra: str) -> str:
    """How to add an extra: `pip install -e '<the checkout>[extra]'` where the checkout is known."""
    where = checkout()
    if where is not None and (where / "pyproject.toml").is_file():
        return f"pip install -e '{where}[{extra}]'"
    return f"pip install -e '.[{extra}]' in patchkit's checkout"


def _requirement_name(requirement: str) -> str:
    match = _NAME.match(requirement)
    return match.group(1).lower().replace("_", "-") if match else requirement


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def packages() -> dict[str, Any]:
    """patchkit's distribution and version, its dependencies' versions, and each extra's packages' versions
    (None: not installed), as the installed metadata lists them."""
    found = distribution()
    if found is None:
        return {"distribution": None, "version": None, "requires": {}, "extras": {}}
    own = found.metadata["Name"].lower()
    requires: dict[str, str | None] = {}
    extras: dict[str, dict[str, str | None]] = {extra: {} for extra in found.metadata.get_all("Provides-Extra") or []}
    for requirement in found.requires or []:
        name = _requirement_name(requirement)
        marker = _EXTRA.search(requirement.partition(";")[2])
        if name == own:  # `dev` names other extras of patchkit's: they are listed on their own
            continue
        (extras.setdefault(marker.group(1), {}) if marker else requires)[name] = _version(name)
    return {"distribution": found.metadata["Name"], "version": found.version, "requires": requires, "extras": extras}


def cpu_report() -> dict[str, Any]:
    """The CPU's model, which of the flags that matter it has, whether it has AMX, and its cores."""
    flags = cpu.cpu_flags()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "model": cpu.cpu_model(),
        "flags": [f for f in cpu.FLAGS_THAT_MATTER if f in flags],
        "missing": [f for f in cpu.FLAGS_THAT_MATTER if f not in flags],
        "amx": cpu.has_amx(flags),
        "flags_from": "PATCHKIT_CPU_FLAGS" if envs.cpu_flags_override() is not None else "/proc/cpuinfo",
        "cores": os.cpu_count(),
        "usable_cores": usable,
    }


def memory() -> dict[str, float | None]:
    """Total and available memory in GiB, from /proc/meminfo (None where it is not there)."""
    values: dict[str, float | None] = {"total_gib": None, "available_gib": None}
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return values
    for line in lines:
        key, _, rest = line.partition(":")
        target = {"MemTotal": "total_gib", "MemAvailable": "available_gib"}.get(key)
        if target and rest.split():
            values[target] = round(int(rest.split()[0]) / (1 << 20), 1)  # kB
    return values


def gpus() -> dict[str, Any]:
    """The GPUs nvidia-smi lists, and what torch sees (its version, CUDA build, devices) where it is
    installed; torch is imported in a child process, so a broken CUDA install cannot take this one down."""
    found: dict[str, Any] = {"nvidia_smi": None, "torch": None}
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        found["nvidia_smi"] = _run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if find_spec("torch") is not None:
        out = _run([sys.executable, "-c", _TORCH_PROBE])
        try:
            found["torch"] = json.loads(out.splitlines()[-1])
        except (ValueError, IndexError):
            found["torch"] = {"error": out}
    return found


def _run(command: list[str]) -> str:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S, check=False)  # noqa: S603
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"failed: {exc}"
    if done.returncode != 0:
        return f"failed (status {done.returncode}): {(done.stderr.strip().splitlines() or [''])[-1]}"
    return done.stdout.strip()


def environment() -> dict[str, Any]:
    """Everything above, as one JSON-ready mapping (`patchkit doctor --json`'s "environment")."""
    return {
        "python": {"version": platform.python_version(), "implementation": platform.python_implementation(),
                   "executable": sys.executable},
        "os": platform.platform(),
        "cpu": cpu_report(),
        "memory": memory(),
        "gpus": gpus(),
        "patchkit": {"path": str(Path(__file__).resolve().parent.parent), **packages()},
    }
