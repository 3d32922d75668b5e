"""The wheel carries every package directory, and the examples as `patchkit.examples`; the distribution is not
PyPI's `patchkit`, and nothing tells users to install that one."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_listed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "patchkit").rglob("__init__.py")}
    assert set(config["packages"]) == found | {"patchkit.examples"}
    assert config["package-dir"] == {"patchkit.examples": "examples"}
    assert (ROOT / "examples" / "__init__.py").is_file()


PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# Where install instructions are written: the pages, the image, the notebook, and patchkit's own messages.
TOLD = [ROOT / "README.md", ROOT / "Dockerfile", *sorted((ROOT / "docs").rglob("*.md")),
        *sorted((ROOT / "examples").rglob("*.ipynb")), *sorted((ROOT / "patchkit").rglob("*.py"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


def test_the_distribution_is_not_the_other_project_on_pypi() -> None:
    from patchkit.doctor.environment import DISTRIBUTION

    name = PYPROJECT["project"]["name"]
    assert name != "patchkit"  # `patchkit` on PyPI is another project
    assert DISTRIBUTION == name  # `patchkit doctor` reads the extras' versions under this name
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items():
        for requirement in requirements:  # an extra naming others of ours must name this distribution, not PyPI's
            assert not re.match(r"patchkit\[", requirement), (extra, requirement)
    assert f'"{name}[${{EXTRAS}}]"' in (ROOT / "Dockerfile").read_text()  # the image installs the wheel it built


def test_the_project_names_its_repository() -> None:
    urls = PYPROJECT["project"]["urls"]
    assert {"Homepage", "Repository", "Documentation", "Issues"} <= set(urls)
    assert all(url.startswith("https://github.com/patchkit-dev/patchkit") for url in urls.values())


def test_no_page_or_message_installs_the_patchkit_on_pypi() -> None:
    for path in TOLD:
        text = path.read_text()
        # `patchkit[extra]` is always PyPI's project; a code block, the image or a message saying
        # `pip install patchkit` would install it too (prose may warn against it).
        assert not re.search(r"""(?<![\w-])patchkit\[""", text), path
        commands = text if path.suffix in (".py", ".ipynb", "") else "\n".join(FENCE.findall(text))
        assert not re.search(r"""pip install (--?\S+ )*["']?patchkit\b""", commands), path
