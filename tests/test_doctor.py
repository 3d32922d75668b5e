"""`patchkit doctor`: the environment a bug report needs, and each part checked in a process of its own, a
broken part reported (a crash by its signal's name) with a non-zero exit status, a missing extra skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

from patchkit.cli import main
from patchkit.doctor import CHECKS

ROOT = Path(__file__).resolve().parent.parent


def doctor(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`patchkit doctor ARGS` as a user runs it, in a process of its own: its exit status, stdout, stderr."""
    done = subprocess.run([sys.executable, "-m", "patchkit.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})}, cwd=ROOT)
    return done.returncode, done.stdout, done.stderr


def by_name(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in report["checks"]}


def test_the_environment_names_the_cpu_flags_an_injected_amx_and_the_versions(capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATCHKIT_CPU_FLAGS", "avx avx2 fma amx_tile amx_int8 amx_bf16")
    assert main(["doctor", "--check", "port"]) == 0
    text = capsys.readouterr().out
    flags = next(line for line in text.splitlines() if line.strip().startswith("cpu flags"))
    assert "avx2" in flags and "amx_int8" in flags and "AMX: yes" in flags
    assert "not present: " in flags and "avx512f" in flags.split("not present: ")[1]
    assert "(from PATCHKIT_CPU_FLAGS)" in flags
    for key in ("python", "os", "cpu", "memory", "gpus", "requires"):
        assert any(line.strip().startswith(key) for line in text.splitlines()), key
    assert "ok       port" in text

    monkeypatch.setenv("PATCHKIT_CPU_FLAGS", "avx2")
    assert main(["doctor", "--json", "--check", "port"]) == 0
    env = json.loads(capsys.readouterr().out)["environment"]
    cpu = env["cpu"]
    assert cpu["amx"] is False and cpu["flags"] == ["avx2"] and "amx_int8" in cpu["missing"]
    # The versions, read from the installed distribution's metadata.
    kit = env["patchkit"]
    assert kit["version"] and kit["requires"]["bytecode"]  # a dependency, with the version installed
    assert {"retrieval", "llm", "sched", "ray", "gpu"} <= set(kit["extras"])  # the metadata's extras, every one
    assert "llama-cpp-python" in kit["extras"]["llm"] and "highspy" in kit["extras"]["sched"]


@pytest.fixture(scope="module")
def broken() -> tuple[int, dict[str, Any]]:
    """The doctor with two parts broken: a model file that is not there, and a check whose process segfaults."""
    status, out, _ = doctor("--json", "--check", "llama", "--model", "/nonexistent/model.gguf",
                            "--check", "port", "--crash-check", "port")
    return status, json.loads(out)


@pytest.mark.skipif(find_spec("llama_cpp") is None, reason="the llama check needs llama-cpp-python: pip install -e '.[llm]'")
def test_a_model_that_is_not_there_fails_the_llama_check(broken: tuple[int, dict[str, Any]]) -> None:
    status, report = broken
    llama = by_name(report)["llama"]
    assert status == 1 and report["ok"] is False
    assert llama["status"] == "failed"
    assert "FileNotFoundError" in llama["detail"] and "/nonexistent/model.gguf" in llama["detail"]


def test_a_segfault_is_reported_by_its_signal_and_fails_the_run(broken: tuple[int, dict[str, Any]]) -> None:
    status, report = broken
    port = by_name(report)["port"]
    assert status == 1
    assert port["status"] == "failed"
    assert port["detail"].startswith("SIGSEGV in native code"), port["detail"]
    assert "child.py" in port["detail"]  # the Python frame the crash happened under, from faulthandler


def test_the_text_report_says_which_checks_failed() -> None:
    status, out, err = doctor("--check", "port", "--crash-check", "port")
    assert status == 1, err
    assert any(line.split()[:2] == ["failed", "port"] and "SIGSEGV" in line for line in out.splitlines()), out
    assert "1 of 1 checks failed: port" in out


def test_a_check_whose_extra_is_missing_is_skipped_not_failed(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "gurobipy", None)  # as where the `sched` extra is not installed
    monkeypatch.setitem(sys.modules, "ray", None)
    assert main(["doctor", "--json", "--check", "gurobi", "--check", "ray"]) == 0
    checks = by_name(json.loads(capsys.readouterr().out))
    for name, extra in (("gurobi", "sched"), ("ray", "ray")):
        assert checks[name]["status"] == "skipped"
        assert checks[name]["detail"].startswith("not installed") and "pip install -e '" in checks[name]["detail"]
        assert f"[{extra}]" in checks[name]["detail"]


@pytest.mark.skipif(find_spec("sentence_transformers") is None, reason="times the embedder check: pip install -e '.[retrieval]'")
def test_a_check_past_its_timeout_is_stopped_and_failed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--json", "--check", "embedder", "--timeout", "0.2"]) == 1  # torch alone imports for longer
    [embedder] = json.loads(capsys.readouterr().out)["checks"]
    assert embedder["status"] == "failed" and embedder["detail"] == "timed out after 0.2 s (stopped)"


def test_an_unknown_check_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["doctor", "--check", "nosuch"])
    assert exited.value.code == 2
    assert "invalid choice: 'nosuch'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.ray  # the ray check starts a local instance
def test_json_lists_every_check_and_this_machine_passes_them() -> None:
    status, out, err = doctor("--json")
    report = json.loads(out)
    assert [c["name"] for c in report["checks"]] == [c.name for c in CHECKS]
    for check in report["checks"]:
        assert set(check) == {"name", "status", "detail", "seconds"}
        assert check["status"] in ("ok", "skipped"), check
        assert isinstance(check["seconds"], float)
    assert status == 0 and report["ok"] is True, err
    if find_spec("llama_cpp") is not None:
        assert by_name(report)["llama"]["status"] == "ok"
        assert "decoded" in by_name(report)["llama"]["detail"]
