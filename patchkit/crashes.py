"""A process a signal killed, in words: the signal's name, and whether it is a crash in native code (a C
extension's bad memory access, an instruction this CPU lacks, a failed assertion) rather than a stop from
outside. One table, read by the local backend (a worker's death: `orchestrator/backend.py` `signal_death`)
and by `patchkit doctor` (a check's child).
"""

from __future__ import annotations

import signal

__all__ = ["NATIVE_CRASH_SIGNALS", "killed_by", "signal_name"]

# What each signal says about how the process ended, after its name.
_MEANINGS = {
    "SIGSEGV": "in native code",
    "SIGBUS": "in native code",
    "SIGFPE": "in native code",
    "SIGABRT": "in native code (an abort)",
    "SIGILL": "in native code: an instruction this CPU does not have",
    "SIGKILL": "(the kernel's out-of-memory killer, or a kill from outside)",
}
NATIVE_CRASH_SIGNALS = frozenset(name for name, meaning in _MEANINGS.items() if meaning.startswith("in native code"))


def signal_name(number: int) -> str:
    """"SIGSEGV" for 11; "signal N" for a number that names no signal here."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def killed_by(number: int) -> str:
    """The signal `number` and what it means: "SIGSEGV in native code", "SIGTERM"."""
    name = signal_name(number)
    return f"{name} {_MEANINGS.get(name, '')}".rstrip()
