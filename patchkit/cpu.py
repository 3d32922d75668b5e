"""What this machine's CPU is: its model name and the instruction-set flags that decide how native code
may run on it (AVX2, AVX-512, AMX). Read from /proc/cpuinfo on Linux; `PATCHKIT_CPU_FLAGS` stands in for
the flags (see `patchkit.envs.cpu_flags_override`), so a test or a bug report can say "this is an AMX host"
on any machine.

Used by the llama.cpp loader (whether to repack weights for AMX) and by `patchkit doctor`.
"""

from __future__ import annotations

import functools
import platform
from pathlib import Path

from patchkit import envs

__all__ = ["AMX_FLAGS", "FLAGS_THAT_MATTER", "cpu_flags", "cpu_model", "has_amx"]

CPUINFO = Path("/proc/cpuinfo")
AMX_FLAGS = frozenset({"amx_tile", "amx_int8", "amx_bf16", "amx_fp16", "amx_complex"})
# The flags a bug report names: the vector units llama.cpp, FAISS and torch pick their kernels by.
FLAGS_THAT_MATTER = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                     "amx_tile", "amx_int8", "amx_bf16")


def cpu_flags() -> frozenset[str]:
    """The CPU's flags as /proc/cpuinfo lists them (lower case), or `PATCHKIT_CPU_FLAGS` where it is set;
    empty where neither says (not Linux)."""
    override = envs.cpu_flags_override()
    if override is not None:
        return override
    return _cpuinfo_flags()


def has_amx(flags: frozenset[str] | None = None) -> bool:
    """Whether the CPU reports any AMX unit (Intel Sapphire Rapids and later)."""
    return bool((cpu_flags() if flags is None else flags) & AMX_FLAGS)


@functools.cache
def cpu_model() -> str:
    """The CPU's model name ("Intel(R) Xeon(R) Platinum 8480+"), or what `platform` says where /proc has none."""
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine() or "unknown"


@functools.cache
def _cpuinfo_flags() -> frozenset[str]:
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):  # x86, then arm64's name for them
            return frozenset(value.lower().split())
    return frozenset()


@functools.cache
def _cpuinfo() -> str:
    try:
        return CPUINFO.read_text(errors="replace")
    except OSError:
        return ""
