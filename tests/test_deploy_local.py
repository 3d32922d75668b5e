"""The `local` backend end to end: a front-end process and real worker processes over gRPC.

Deployed answers equal eager ones on the whole corpus; a worker killed under load costs no
request; close() drains and leaves no process behind, nor does the user's process dying; a
component's error reaches the caller; a failing setup() fails deploy() with nothing left running.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from components import BrokenSetup, Flaky, Generator, Grader, Slow
from corpus import CASES, Case
from test_capture_corpus import _capture

import patchkit
from patchkit import ComponentError, DeadlineExceeded, PatchkitError, WorkerDiedError

TESTS = Path(__file__).parent

pytestmark = pytest.mark.slow


# -- processes, as /proc shows them (Linux) ---------------------------------------------------------
def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process, or None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    state, ppid = text[text.rindex(")") + 2 :].split()[:2]  # the command name, in parentheses, may hold spaces
    return state, int(ppid)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return b""


def _children(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == pid and stat[0] != "Z":
                found.add(int(entry.name))
    return found


def _descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        for child in _children(todo.pop()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie: a zombie has exited, and an orphan's is init's to reap."""
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def _wait_until(condition: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout_s:g} s waiting until {what}")
        time.sleep(0.02)


def _worker_pids(endpoint: patchkit.Endpoint, component: str | None = None) -> list[int]:
    components = endpoint.stats()["components"]
    names = [component] if component is not None else list(components)
    return [r["pid"] for name in names for r in components[name]["replicas"]]


def _in_threads(fn: Callable[[int], Any], count: int) -> tuple[list[threading.Thread], dict[int, Any]]:
    """Start `fn(i)` for i in range(count), each on a thread; results (or exceptions) land in the dict."""
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        try:
            results[i] = fn(i)
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, results


def _join(threads: list[threading.Thread], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = sum(t.is_alive() for t in threads)
    assert hung == 0, f"{hung} of {len(threads)} requests never returned"


# -- pipelines ------------------------------------------------------------------------------------
def _echo_pipeline(slow: Slow) -> patchkit.Pipeline:
    text = "warm up"
    with patchkit.capture() as pipeline:
        answer = slow.echo(text)  # noqa: F841 - the block's output
    return pipeline


def _nap_pipeline(slow: Slow) -> patchkit.Pipeline:
    text = "warm up"
    with patchkit.capture() as pipeline:
        answer = slow.nap(text)  # noqa: F841 - the block's output
    return pipeline


# -- 1. deployed answers equal eager answers --------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_deployed_pipeline_answers_like_eager(case: Case) -> None:
    pipeline, _ = _capture(case)
    # The HTTP API is JSON: tuples come back as lists.
    expected = [json.loads(json.dumps(pipeline(**inputs))) for inputs in case.inputs]
    # Every input is required over HTTP unless listed; list only those the case leaves out.
    optional = tuple(name for name in pipeline.inputs if any(name not in inputs for inputs in case.inputs))
    with patchkit.deploy(pipeline, backend="local", optional_inputs=optional) as endpoint:
        assert [endpoint.query(**inputs) for inputs in case.inputs] == expected
        # All at once too, so calls of different requests share batches on the workers.
        with ThreadPoolExecutor(2 * len(case.inputs)) as pool:
            answers = list(pool.map(lambda inputs: endpoint.query(**inputs), case.inputs * 2))
        assert answers == expected * 2


# -- 2. a worker killed under load ----------------------------------------------------------------
def test_sigkilled_replica_costs_no_request_and_is_restarted() -> None:
    requests = 200
    slow = Slow(seconds=0.01)
    with patchkit.deploy(_echo_pipeline(slow), replicas=2, request_timeout_s=60) as endpoint:
        before = _worker_pids(endpoint, "slow")
        assert len(before) == 2 and all(_running(pid) for pid in before)
        threads, results = _in_threads(lambda i: endpoint.query(text=f"request {i}"), requests)
        _wait_until(lambda: len(results) >= requests // 4, "a quarter of the requests were answered")
        assert len(results) < requests, "the load ended before the kill: nothing was in flight"
        os.kill(before[0], signal.SIGKILL)
        _join(threads)
        wrong = {i: r for i, r in results.items() if r != f"REQUEST {i}"}
        assert not wrong, f"{len(wrong)} requests failed or answered wrongly, e.g. {next(iter(wrong.items()))}"

        def restarted() -> dict[str, Any] | None:
            stats = endpoint.stats()
            replicas = stats["components"]["slow"]["replicas"]
            ok = stats["restarts"] >= 1 and len(replicas) == 2 and all(r["alive"] for r in replicas)
            return stats if ok else None

        stats = _wait_until(restarted, "the killed replica was restarted")
        after = [r["pid"] for r in stats["components"]["slow"]["replicas"]]
        assert before[0] not in after and before[1] in after
        new = (set(after) - set(before)).pop()
        assert _running(new)
        # The calls the killed replica held were sent again, not lost.
        assert stats["components"]["slow"]["methods"]["echo"]["retries"] >= 1
        _wait_until(lambda: _stat(before[0]) is None, "the killed worker was reaped")
        assert endpoint.query(text="after") == "AFTER"


def test_sigkilled_only_replica_fails_requests_cleanly_or_not_at_all() -> None:
    requests = 100
    slow = Slow(seconds=0.01)
    with patchkit.deploy(_echo_pipeline(slow), request_timeout_s=30) as endpoint:
        [pid] = _worker_pids(endpoint, "slow")
        threads, results = _in_threads(lambda i: endpoint.query(text=f"request {i}"), requests)
        _wait_until(lambda: len(results) >= requests // 4, "a quarter of the requests were answered")
        assert len(results) < requests, "the load ended before the kill: nothing was in flight"
        os.kill(pid, signal.SIGKILL)
        _join(threads)
        for i, result in results.items():
            if isinstance(result, Exception):
                assert isinstance(result, (WorkerDiedError, DeadlineExceeded)), repr(result)
            else:
                assert result == f"REQUEST {i}"
        _wait_until(lambda: endpoint.stats()["restarts"] >= 1, "the replica was restarted")
        [new] = _wait_until(lambda: _worker_pids(endpoint, "slow"), "the new replica was listed")
        assert new != pid and _running(new)
        assert endpoint.query(text="after") == "AFTER"


# -- 3. close() drains and stops everything -------------------------------------------------------
def test_close_drains_inflight_requests_and_leaves_no_process() -> None:
    requests = 4
    slow = Slow(seconds=0.5)
    ours = _children(os.getpid())
    endpoint = patchkit.deploy(_nap_pipeline(slow), replicas=2)
    try:
        [frontend] = [pid for pid in _children(os.getpid()) - ours if b"patchkit.server.process" in _cmdline(pid)]
        workers = _worker_pids(endpoint)
        assert _children(frontend) == set(workers) and len(workers) == 2
        threads, results = _in_threads(lambda i: endpoint.query(text=f"request {i}"), requests)
        _wait_until(lambda: endpoint.stats()["requests"]["inflight"] == requests, "every request was in flight")
    finally:
        endpoint.close()
    _join(threads)
    assert results == {i: f"request {i}"[::-1] for i in range(requests)}
    left = [pid for pid in [frontend, *workers] if _stat(pid) is not None]
    assert not left, f"processes left after close(): {left}"
    with pytest.raises(PatchkitError, match="closed"):
        endpoint.query(text="too late")


# -- 4. the user's process dying ------------------------------------------------------------------
USER_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, {tests!r})
    import patchkit
    from components import Generator

    llm = Generator(prefix="U")
    query = "warm up"
    with patchkit.capture() as pipeline:
        answer = llm.generate(query)
    endpoint = patchkit.deploy(pipeline, backend="local", replicas=2)
    workers = [r["pid"] for c in endpoint.stats()["components"].values() for r in c["replicas"]]
    print(json.dumps({{"answer": endpoint.query(query="hello there"), "workers": workers}}), flush=True)
    time.sleep(600)
    """
)


def test_user_process_killed_leaves_no_worker(tmp_path: Path) -> None:
    stderr = (tmp_path / "stderr.txt").open("wb")
    user = subprocess.Popen([sys.executable, "-c", USER_SCRIPT.format(tests=str(TESTS))], stdout=subprocess.PIPE, stderr=stderr)
    assert user.stdout is not None
    try:
        ready, _, _ = select.select([user.stdout], [], [], 120)
        line = user.stdout.readline() if ready else b""
        assert line, (tmp_path / "stderr.txt").read_text()
        report = json.loads(line)
        assert report["answer"] == Generator(prefix="U").generate("hello there")
        [frontend] = _children(user.pid)
        assert _children(frontend) == set(report["workers"]) and len(report["workers"]) == 2
        everything = _descendants(user.pid)
        user.send_signal(signal.SIGKILL)
        user.wait()
        _wait_until(lambda: not any(_running(pid) for pid in everything), "every process of the deployment exited", 10)
    finally:
        if user.poll() is None:
            user.kill()
            user.wait()
        user.stdout.close()
        stderr.close()


# -- 5. a component that raises -------------------------------------------------------------------
@pytest.fixture(scope="module")
def flaky_endpoint() -> Iterator[patchkit.Endpoint]:
    flaky = Flaky()
    text = "warm up"
    with patchkit.capture() as pipeline:
        checked = flaky.check(text)  # noqa: F841 - the block's output
    with patchkit.deploy(pipeline, backend="local") as endpoint:
        yield endpoint


def test_component_error_reaches_the_caller_and_the_endpoint_keeps_serving(flaky_endpoint: patchkit.Endpoint) -> None:
    with pytest.raises(ComponentError) as raised:
        flaky_endpoint.query(text="please fail")
    error = raised.value
    assert "cannot check 'please fail'" in str(error) and "ValueError" in str(error)
    assert (error.component, error.method) == ("flaky", "check")
    assert error.traceback_text == ""  # replies carry tracebacks only with deploy(debug=True)
    assert flaky_endpoint.query(text="fine") == "FINE"


def test_failing_requests_do_not_fail_their_neighbours(flaky_endpoint: patchkit.Endpoint) -> None:
    texts = [f"{'fail' if i % 3 == 0 else 'pass'} {i}" for i in range(30)]
    threads, results = _in_threads(lambda i: flaky_endpoint.query(text=texts[i]), len(texts))
    _join(threads)
    for i, text in enumerate(texts):
        if "fail" in text:
            assert isinstance(results[i], ComponentError) and repr(text) in str(results[i]), results[i]
        else:
            assert results[i] == text.upper()


# -- 6. setup() raising at deploy -----------------------------------------------------------------
def test_setup_error_fails_deploy_and_leaves_no_process() -> None:
    llm, broken = Generator(prefix="S"), BrokenSetup()
    text = "warm up"
    with patchkit.capture(run=False) as pipeline:  # an eager run would call setup() here
        answer = broken.answer(llm.generate(text))  # noqa: F841 - the block's output
    ours = _descendants(os.getpid())
    with pytest.raises(ComponentError) as raised:
        patchkit.deploy(pipeline, backend="local", replicas=2)
    error = raised.value
    assert (error.component, error.method) == ("broken", "setup")
    assert "broken.setup" in str(error) and "RuntimeError: model file is missing" in str(error)
    assert "model file is missing" in error.traceback_text
    left = [pid for pid in _descendants(os.getpid()) - ours if _running(pid)]
    assert not left, f"processes left after a failed deploy: {left}"


def test_a_component_whose_arguments_do_not_pickle_is_refused_with_what_to_do() -> None:
    holder = Grader(threshold=threading.Lock())  # type: ignore[arg-type]

    def body(query: str) -> patchkit.Pipeline:
        with patchkit.capture(run=False) as pipeline:
            return holder.grade(query, [])
        return pipeline

    body("x")
    with pytest.raises(patchkit.PatchkitError, match="constructor arguments must pickle"):
        patchkit.deploy(patchkit.last_pipeline())


class Sized(patchkit.Component):
    """Records the batch sizes its deployment told it, and whether it heard them before its setup()."""

    def __init__(self) -> None:
        self.told: dict[str, int] = {}

    def serve_sizes(self, batch_sizes: Any) -> None:
        self.told = dict(batch_sizes)

    def setup(self) -> None:
        self.at_setup = dict(self.told)

    @patchkit.make(max_concurrency=8)
    def ask(self, x: int) -> int:
        return x + 1

    @patchkit.make(batch=True, max_batch_size=64)
    def bulk(self, xs: list[int]) -> list[int]:
        return [x * 2 for x in xs]

    def stats(self) -> dict[str, Any]:
        return {f"{method}_at_setup": size for method, size in self.at_setup.items()}


def test_each_replica_hears_its_batch_sizes_before_setup() -> None:
    def asking(sized: Sized) -> patchkit.Pipeline:
        x = 1
        with patchkit.capture(run=False) as pipeline:
            return sized.bulk(sized.ask(x))  # type: ignore[no-any-return]
        return pipeline

    with patchkit.deploy(asking(Sized()), replicas=2, batch_size={"sized.ask": 20, "sized.bulk": 5}) as endpoint:
        assert endpoint.query(x=1) == 4
        reports = [r["component_stats"] for r in endpoint.stats()["replica_reports"].values()]
    # Calls at once of a max_concurrency method are its batch size up to that bound; a batch method's, its batch size.
    assert reports == [{"ask_at_setup": 8, "bulk_at_setup": 5}] * 2
