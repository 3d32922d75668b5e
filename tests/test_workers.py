"""Worker processes on their own: pinned resources, the deployment secret, batches over the stream."""

from __future__ import annotations

import asyncio
import os
import pickle
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from components import Generator, Grader

from patchkit import ComponentError, WorkerDiedError
from patchkit.orchestrator.backend import ReplicaSpec
from patchkit.orchestrator.envelope import CallEnvelope
from patchkit.orchestrator.local import LocalBackend
from patchkit.orchestrator.resources import ReplicaResources, spread
from patchkit.orchestrator.rpc import BATCHES, SECRET_KEY

pytestmark = pytest.mark.slow


class _WritesMarker:
    """Unpickling this writes a file: proof that a payload was unpickled."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path(self.path).write_text, ("unpickled",))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_resources_spread_over_cores_and_set_thread_counts() -> None:
    assert [r.cpus for r in spread(2, [0, 1, 2, 3])] == [(0, 1), (2, 3)]
    assert [r.threads for r in spread(2, [0, 1, 2, 3])] == [2, 2]
    assert [r.cpus for r in spread(3, [0, 1])] == [(), (), ()]
    env = ReplicaResources(cpus=(1,), threads=3, gpus=(2, 5)).environment()
    assert env["OMP_NUM_THREADS"] == "3" and env["MKL_NUM_THREADS"] == "3"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,5"
    assert ReplicaResources(gpus=()).environment()["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(ValueError, match="threads must be >= 1"):
        ReplicaResources(threads=0)


def test_a_worker_runs_pinned_and_answers_batches() -> None:
    cores = sorted(os.sched_getaffinity(0))
    resources = ReplicaResources(cpus=(cores[-1],), threads=1, gpus=())

    async def main() -> tuple[list[Any], dict[str, Any]]:
        backend = LocalBackend("s3cret")
        replica = await backend.start(ReplicaSpec("llm", Generator(prefix="W"), resources), "llm#0")
        try:
            assert backend.replicas() == [replica]
            outcomes = await replica.channel.run_batch("rewrite", [CallEnvelope(("How do I loop",), {}),
                                                                        CallEnvelope(("What is x",), {})])
            return outcomes, await replica.channel.stats()
        finally:
            await backend.stop(replica)
            assert backend.replicas() == []

    outcomes, stats = run(main())
    assert outcomes == [(True, "how to loop python"), (True, "what is x python")]
    assert stats["affinity"] == [cores[-1]]
    assert stats["threads"] == "1" and stats["cuda_visible_devices"] == ""
    assert stats["pid"] != os.getpid() and stats["batches"] == 1 and stats["calls"] == 2


def test_a_wrong_secret_is_refused_before_any_payload_is_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "marker"

    async def main() -> grpc.StatusCode:
        backend = LocalBackend("the-right-secret")
        replica = await backend.start(ReplicaSpec("grader", Grader()), "grader#0")
        try:
            assert replica.address is not None
            async with grpc.aio.insecure_channel(replica.address) as channel:
                call = channel.stream_stream(BATCHES)(metadata=((SECRET_KEY, "a-wrong-secret"),))
                await call.write(pickle.dumps(_WritesMarker(str(marker))))
                try:
                    await call.read()
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK
        finally:
            await backend.stop(replica)

    assert run(main()) == grpc.StatusCode.UNAUTHENTICATED
    assert not marker.exists()


def test_a_worker_whose_setup_raises_reports_the_error() -> None:
    from components import BrokenSetup

    async def main() -> None:
        await LocalBackend("s").start(ReplicaSpec("broken", BrokenSetup()), "broken#0")

    with pytest.raises(ComponentError, match="broken.setup raised: RuntimeError: model file is missing") as raised:
        run(main())
    assert "raise RuntimeError" in raised.value.traceback_text


def test_a_killed_worker_fails_its_batches_in_flight() -> None:
    from components import Slow

    async def main() -> None:
        backend = LocalBackend("s")
        replica = await backend.start(ReplicaSpec("slow", Slow(seconds=5.0)), "slow#0")
        try:
            pending = asyncio.ensure_future(replica.channel.run_batch("nap", [CallEnvelope(("x",), {})]))
            await asyncio.sleep(0.3)
            assert replica.pid is not None
            os.kill(replica.pid, 9)
            with pytest.raises(WorkerDiedError, match="died with a batch in flight"):
                await pending
            assert "exited" in await backend.watch(replica) or not replica.alive
        finally:
            await backend.stop(replica)

    run(main())
