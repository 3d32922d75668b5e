"""Every `PATCHKIT_*` environment variable patchkit reads, with its default, in one place."""

from __future__ import annotations

import os
from pathlib import Path

from patchkit.errors import ConfigError

__all__ = ["auth_token", "cache_dir", "cpu_flags_override", "slow_step_s", "worker_start_timeout_s", "worker_stop_timeout_s"]


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise ConfigError(f"{name}={raw!r} is not a number of seconds > 0")
    return value


def worker_start_timeout_s() -> float:
    """PATCHKIT_WORKER_START_TIMEOUT_S: how long a worker may take to import, build and `setup()` (600)."""
    return _float("PATCHKIT_WORKER_START_TIMEOUT_S", 600.0)


def worker_stop_timeout_s() -> float:
    """PATCHKIT_WORKER_STOP_TIMEOUT_S: how long a stopping worker gets before SIGKILL (5)."""
    return _float("PATCHKIT_WORKER_STOP_TIMEOUT_S", 5.0)


def cache_dir() -> Path:
    """PATCHKIT_CACHE_DIR: where built indexes, the pydoc corpus and profiles are kept between runs (~/.cache/patchkit)."""
    raw = os.environ.get("PATCHKIT_CACHE_DIR")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "patchkit"


def auth_token() -> str | None:
    """PATCHKIT_AUTH_TOKEN: the bearer token every HTTP route but /healthz and /readyz asks for, when
    `deploy(auth_token=...)` gives none (unset: no authentication)."""
    return os.environ.get("PATCHKIT_AUTH_TOKEN") or None


def slow_step_s() -> float:
    """PATCHKIT_SLOW_STEP_S: how long one step of an `async def` component method (its code between two
    awaits) may hold the event loop before a warning names the method (0.1, asyncio debug mode's threshold)."""
    return _float("PATCHKIT_SLOW_STEP_S", 0.1)


def cpu_flags_override() -> frozenset[str] | None:
    """PATCHKIT_CPU_FLAGS: the CPU flags patchkit acts on in place of /proc/cpuinfo's, separated by spaces or
    commas (unset: the CPU's own). For tests and bug reports: `PATCHKIT_CPU_FLAGS="avx2 amx_int8"` makes any
    machine load llama.cpp as an AMX host does."""
    raw = os.environ.get("PATCHKIT_CPU_FLAGS")
    if raw is None:
        return None
    return frozenset(raw.lower().replace(",", " ").split())
