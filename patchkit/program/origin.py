"""Whose code a module is: the user's own, which a version follows into, or the standard library's, patchkit's
or an installed distribution's, which count by their names.

Decided from explicit inputs: the module's name, `sys.stdlib_module_names`, and the installed distributions'
metadata (which top-level names each provides, and whether it is installed editable), never from where a
file happens to live; so it is the same however patchkit itself is installed (from a wheel, editable, in a
container) and however the user's code runs (a script, `python -m`, a notebook).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from functools import lru_cache

__all__ = ["users_module"]


@lru_cache(maxsize=1)
def _installed_distributions() -> dict[str, tuple[str, ...]]:
    """Top-level module name -> the base folders of the distributions installed (not editable) that provide it."""
    provided: dict[str, list[str]] = {}
    for name, distributions in importlib.metadata.packages_distributions().items():
        for distribution in dict.fromkeys(distributions):
            try:
                found = importlib.metadata.distribution(distribution)
            except importlib.metadata.PackageNotFoundError:
                continue
            if not _editable(found):
                provided.setdefault(name, []).append(os.path.realpath(str(found.locate_file(""))))
    return {name: tuple(bases) for name, bases in provided.items()}


def _editable(distribution: importlib.metadata.Distribution) -> bool:
    """Whether `distribution` is installed editable (`pip install -e`): its code is a checkout being edited."""
    try:
        direct = json.loads(distribution.read_text("direct_url.json") or "{}")
    except ValueError:
        return False
    return bool(direct.get("dir_info", {}).get("editable"))


def users_module(module_name: str | None) -> bool:
    """Whether code of module `module_name` is the user's own, followed into: every module but the standard
    library's, patchkit's, and an installed distribution's (one installed editable is the user's), whatever
    the install and however the code runs (a script, `python -m`, a notebook, a class sent by value).

    A top-level name an installed distribution provides is that distribution's, unless the module loaded
    under it is a file outside the distribution's folder (the user's own `utils.py` beside one installed)."""
    if not module_name or module_name == "builtins":
        return False
    root = module_name.partition(".")[0]
    if root == "patchkit" or root in sys.stdlib_module_names:
        return False
    bases = _installed_distributions().get(root)
    if bases is None:
        return True
    module = sys.modules.get(module_name)
    file = getattr(module, "__file__", None) if module is not None else None
    return file is not None and not os.path.realpath(file).startswith(tuple(os.path.join(b, "") for b in bases))
