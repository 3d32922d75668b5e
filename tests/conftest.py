from __future__ import annotations

import copy
import secrets
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import pytest  # noqa: E402
from components import Flaky, Generator, Grader, Retriever  # noqa: E402

import patchkit  # noqa: E402


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip the tests marked `gpu`, saying why, where no NVIDIA GPU is visible."""
    marked = [item for item in items if item.get_closest_marker("gpu")]
    reason = _no_gpu_reason() if marked else None
    if reason is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


def _no_gpu_reason() -> str | None:
    if shutil.which("nvidia-smi") is None:  # costs nothing, unlike importing torch
        return "needs an NVIDIA GPU: nvidia-smi is not on PATH"
    try:
        import torch
    except ImportError:
        return None  # the tests themselves skip without the libraries they need
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU: torch sees none (a CPU build of torch, or CUDA_VISIBLE_DEVICES hides them)"
    return None


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


@pytest.fixture
def profile_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Profiles cached under the test's own directory, not the user's cache."""
    monkeypatch.setenv("PATCHKIT_CACHE_DIR", str(tmp_path))
    return tmp_path / "profiles"


@pytest.fixture
def workers_started(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The replica ids of every local worker started from here on (the profiler's are `profile-NAME`)."""
    from patchkit.orchestrator.local import LocalBackend

    started: list[str] = []
    start = LocalBackend.start

    async def counted(self: LocalBackend, spec: object, replica_id: str) -> object:
        started.append(replica_id)
        return await start(self, spec, replica_id)  # type: ignore[arg-type]

    monkeypatch.setattr(LocalBackend, "start", counted)
    return started


@pytest.fixture(scope="session")
def ray_environment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """What every local Ray instance of the session runs with; a folder for their files. Ray reads some of these
    variables once, at its import: so one token (not ~/.ray/auth_token) serves every module's instance."""
    tmp = tmp_path_factory.mktemp("ray")
    token = tmp / "auth_token"
    token.write_text(secrets.token_hex(16))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's own switch: nodes on loopback only
        env.setenv("RAY_AUTH_MODE", "token")
        env.setenv("RAY_AUTH_TOKEN_PATH", str(token))
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        env.delenv("RAY_ADDRESS", raising=False)
        yield tmp
