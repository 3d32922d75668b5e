"""The wheel carries every package directory, and the examples as `patchkit.examples`."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "patchkit").rglob("__init__.py")}
    assert set(config["packages"]) == found | {"patchkit.examples"}
    assert config["package-dir"] == {"patchkit.examples": "examples"}
    assert (ROOT / "examples" / "__init__.py").is_file()
