"""One of `patchkit doctor`'s checks, run in a process of its own: `python -m patchkit.doctor.child NAME
[--model PATH]`. It prints what the check did as one JSON line (`{"detail": ...}`) on stdout and exits 0,
or prints the error's traceback, then the error on one line, on stderr and exits 1; a crash in native code
kills it, and faulthandler writes the Python frames it was in on stderr, which the parent reads back
(`patchkit.doctor.runner`).

`--crash` is for patchkit's own tests only: the child kills itself with SIGSEGV where the check would run,
so the tests see how a crash in native code is reported without needing a library that crashes.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import traceback

from patchkit.doctor.checks import by_name

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run the check named on the command line; called as `python -m patchkit.doctor.child`."""
    faulthandler.enable()  # a native crash leaves the Python frames it happened under on stderr
    given = argparse.ArgumentParser(prog="python -m patchkit.doctor.child")
    given.add_argument("name")
    given.add_argument("--model", default=None)
    given.add_argument("--crash", action="store_true", help=argparse.SUPPRESS)  # tests only: see the module's docstring
    args = given.parse_args(argv)
    check = by_name(args.name)
    if args.crash:
        os.kill(os.getpid(), signal.SIGSEGV)
    try:
        detail = check.run(args.model)
    except Exception as exc:  # noqa: BLE001 - any failure is the check's: its traceback, then its one line
        traceback.print_exc()
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(json.dumps({"detail": detail}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
