from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from components import Flaky, Generator, Grader, Retriever  # noqa: E402

import patchkit  # noqa: E402


def component_namespace() -> dict[str, Any]:
    """Fresh components under the names the corpus uses."""
    return {
        "patchkit": patchkit,
        "retriever": Retriever(topk=2),
        "grader": Grader(threshold=1),
        "llm": Generator(prefix="A"),
        "llm2": Generator(prefix="B"),
        "flaky": Flaky(),
    }


def load_source(source: str, filename: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Execute source code (it has no file: the `exec` case) in a fresh namespace and return it."""
    namespace = {**component_namespace(), **copy.deepcopy(extra or {})}
    namespace["__name__"] = "corpus"
    exec(compile(source, filename, "exec"), namespace)
    return namespace
