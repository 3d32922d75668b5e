"""What every result file under benchmarks/results/ says about its run: the machine (with the load average
at its start and end, since a busy machine moves the numbers), the date, the commit and the command.

docs/hooks/benchmark_results.py refuses a result file without these; a benchmark that writes one builds it
with `result_file()` and writes it with `write()`.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def commit() -> str:
    """The checkout's commit, short, as the result files name it."""
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return found.stdout.strip() or "unknown"


def machine(load_before: float) -> str:
    """The CPU, its vCPUs, the load average (1 minute) before the run and now, and the Python."""
    from patchkit.cpu import cpu_model

    return (f"{cpu_model()}, {os.cpu_count()} vCPUs, load average {load_before:.2f} before and "
            f"{os.getloadavg()[0]:.2f} after, Python {platform.python_version()}")


def result_file(*, title: str, components: str, load_before: float, setup: str, tables: list[dict[str, Any]],
                plots: list[dict[str, Any]], **data: Any) -> dict[str, Any]:
    """A result file's fields, the provenance filled in: the command is this script with its arguments."""
    script = Path(sys.argv[0]).resolve()
    where = script.relative_to(ROOT) if script.is_relative_to(ROOT) else script.name
    return {"title": title, "components": components, "machine": machine(load_before),
            "date": time.strftime("%Y-%m-%d"), "commit": commit(),
            "command": " ".join(["python", str(where), *sys.argv[1:]]), "setup": setup, "tables": tables,
            "plots": plots, **data}


def write(path: str | Path, result: dict[str, Any]) -> None:
    """Write a result file as the site's hook reads it."""
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
