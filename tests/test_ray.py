"""The `ray` backend on a real, local Ray instance: replicas as actors placed by Ray's scheduler.

One Ray instance serves the whole module: bound to 127.0.0.1, its temporary directory and
authentication token inside the test's own temporary directory, with 4 CPUs, 2 (declared) GPUs and
custom resources `node_a`/`node_b` standing for the nodes of a cluster. Deployed answers equal the
local backend's; fractional GPUs and custom resources are what Ray reserves; an actor killed under
load costs no request and Ray restarts it; a replica that cannot be placed fails deploy() with an
error naming what is missing; TLS (on by default) and the secret guard the workers; async components
serve there as on the local backend.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

import patchkit
from patchkit import WorkerDiedError
from patchkit.components.testing import Simulated
from patchkit.config import DeploymentConfig
from patchkit.orchestrator.ray_backend import cluster_resources
from patchkit.orchestrator.rpc import HEALTH
from patchkit.scheduler.offline.plan import ComponentPlan, Plan

if importlib.util.find_spec("ray") is None:
    pytest.skip("needs ray (the ray extra)", allow_module_level=True)

CLUSTER = {"num_cpus": 8, "num_gpus": 2, "resources": {"node_a": 2, "node_b": 2}}


@pytest.fixture(scope="module")
def cluster(ray_environment: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local Ray instance for the module; its address. Ray writes only under the module's tmp dir."""
    tmp = tmp_path_factory.mktemp("ray")
    home_token = Path.home() / ".ray" / "auth_token"
    had_home_token = home_token.exists()
    import ray  # after the session's Ray variables (conftest.py): Ray reads some of them once, at import

    ray.init(
        **CLUSTER, _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=str(tmp / "r"),
        configure_logging=False, log_to_driver=False,
    )
    try:
        session = Path(ray._private.worker._global_node.get_session_dir_path())
        assert session.is_relative_to(tmp), f"Ray writes its session to {session}, outside {tmp}"
        assert had_home_token or not home_token.exists(), "Ray wrote ~/.ray/auth_token"
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _wait_until(condition: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up after {timeout_s:g} s waiting until {what}")
        time.sleep(0.05)
    return value


def _replicas(endpoint: patchkit.Endpoint, component: str) -> list[dict[str, Any]]:
    replicas: list[dict[str, Any]] = endpoint.stats()["components"][component]["replicas"]
    return replicas


def _free(resource: str) -> float:
    import ray

    return float(ray.available_resources().get(resource, 0.0))


def _one(a: Simulated) -> patchkit.Pipeline:
    """x -> a.run"""
    x = 1
    with patchkit.capture(run=False) as pipeline:
        answer = a.run(x)  # noqa: F841 - the block's output
    return pipeline


def _two(encode: Simulated, rank: Simulated) -> patchkit.Pipeline:
    """x -> encode.run -> rank.run"""
    x = 1
    with patchkit.capture(run=False) as pipeline:
        answer = rank.run(encode.run(x))  # noqa: F841 - the block's output
    return pipeline


# -- configuration (no Ray started) -------------------------------------------------------------
def test_ray_options_are_checked_where_given() -> None:
    pipeline = _one(Simulated(0))
    with pytest.raises(ValueError, match="ray_address is an option of backend='ray'"):
        DeploymentConfig.resolve(pipeline, backend="local", ray_address="auto")
    with pytest.raises(ValueError, match=r"tls_cert \('c.pem'\) and tls_key \(None\) go together"):
        DeploymentConfig.resolve(pipeline, backend="ray", tls_cert="c.pem")
    with pytest.raises(ValueError, match="may set num_cpus, num_gpus"):
        DeploymentConfig.resolve(pipeline, backend="ray", ray_actor_options={"a": {"gpus": 1}})
    with pytest.raises(patchkit.ConfigError, match="ray_actor_options names 'b'"):
        DeploymentConfig.resolve(pipeline, backend="ray", ray_actor_options={"b": {"num_cpus": 1}})
    with pytest.raises(ValueError, match="ray_placement_timeout_s must be"):
        DeploymentConfig.resolve(pipeline, backend="ray", ray_placement_timeout_s=0)
    with pytest.raises(patchkit.ConfigError, match=r"tls=False turns TLS off, but tls_cert='c.pem', tls_key='k.pem' ask"):
        DeploymentConfig.resolve(pipeline, backend="ray", tls=False, tls_cert="c.pem", tls_key="k.pem")
    config = DeploymentConfig.resolve(pipeline, backend="ray", ray_actor_options={"a": {"num_gpus": 0.5}}, secret="s")
    assert config.ray_options().actor_options == {"a": {"num_gpus": 0.5}}


# -- on a Ray instance ----------------------------------------------------------------------------
@pytest.mark.ray
@pytest.mark.slow
def test_example_answers_on_ray_as_on_the_local_backend(cluster: str) -> None:
    example = importlib.import_module("patchkit.examples.figure9")
    questions = ["Which Linux distro suits beginners best?", "What should I cook tonight?", "How do I learn Python?"]
    with patchkit.deploy(example.pipeline, backend="local") as endpoint:
        expected = [endpoint.query(query=q) for q in questions]
    assert expected == [json.loads(json.dumps(example.pipeline(query=q))) for q in questions]
    with patchkit.deploy(example.pipeline, backend="ray", ray_address=cluster) as endpoint:
        assert [endpoint.query(query=q) for q in questions] == expected
        with ThreadPoolExecutor(6) as pool:  # calls of different requests share batches on the actors
            assert list(pool.map(lambda q: endpoint.query(query=q), questions * 4)) == expected * 4
        replicas = [r for c in endpoint.stats()["components"].values() for r in c["replicas"]]
        assert len(replicas) == len(example.pipeline.components) and all(r["address"].startswith("127.0.0.1:") for r in replicas)
        assert _free("CPU") == CLUSTER["num_cpus"] - len(replicas)  # one CPU per replica, reserved through Ray
    _wait_until(lambda: _free("CPU") == CLUSTER["num_cpus"], "close() gave every actor's CPU back")


@pytest.mark.ray
@pytest.mark.slow
def test_plan_shares_gpus_in_fractions_and_custom_resources_place_replicas(cluster: str) -> None:
    encode = Simulated(1, resource="gpu", output=lambda item: item * 10)
    rank = Simulated(1, output=lambda item: item + 1)
    pipeline = _two(encode, rank)
    assert cluster_resources(cluster) == {"cpu": CLUSTER["num_cpus"], "gpu": CLUSTER["num_gpus"]}  # what plan() plans for
    plan = Plan({"encode": ComponentPlan("gpu", 3, 4), "rank": ComponentPlan("cpu", 1, 4)}, 1.0, "encode")
    options = {"rank": {"resources": {"node_b": 1}, "memory": 2**20}}
    with patchkit.deploy(pipeline, backend="ray", ray_address=cluster, plan=plan, ray_actor_options=options,
                         autoscale=False) as endpoint:
        assert [endpoint.query(x=x) for x in range(5)] == [x * 10 + 1 for x in range(5)]
        # Three GPU replicas on two GPUs: half a GPU each, so that they pack; the CPU replica on a node_b node.
        assert _free("GPU") == pytest.approx(CLUSTER["num_gpus"] - 3 * 0.5)
        assert _free("node_b") == 1 and _free("node_a") == 2
        assert _free("CPU") == CLUSTER["num_cpus"] - 1  # the GPU replicas take no CPU of the plan's
        stats = endpoint.stats()
        seen = {r["cuda_visible_devices"] for r in stats["replica_reports"].values() if r["component"] == "encode"}
        assert seen <= {"0", "1"} and seen, f"Ray set no GPU for the GPU replicas: {seen}"
        # Workers listen beyond loopback on a cluster: a plaintext call is refused (TLS by default; without it,
        # the secret refuses it: test_workers_serve_tls_by_default_and_plaintext_only_when_asked).
        address = _replicas(endpoint, "rank")[0]["address"]
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(HEALTH)(b"", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.ray
@pytest.mark.slow
def test_an_actor_killed_under_load_costs_no_request_and_ray_restarts_it(
    cluster: str, capfd: pytest.CaptureFixture[str]
) -> None:
    requests = 200
    echo = Simulated(10, output=lambda item: f"echo {item}")
    pipeline = _one(echo)
    with patchkit.deploy(pipeline, backend="ray", ray_address=cluster, replicas=2, batch_size=1, request_timeout_s=60,
                         autoscale=False,
                         ray_max_restarts=2) as endpoint:
        before = [r["pid"] for r in _replicas(endpoint, "a")]
        results: dict[int, Any] = {}

        def ask(i: int) -> None:
            try:
                results[i] = endpoint.query(x=i)
            except Exception as exc:
                results[i] = exc

        threads = [threading.Thread(target=ask, args=(i,), daemon=True) for i in range(requests)]
        for thread in threads:
            thread.start()
        _wait_until(lambda: len(results) >= requests // 4, "a quarter of the requests were answered")
        assert len(results) < requests, "the load ended before the kill: nothing was in flight"
        os.kill(before[0], signal.SIGKILL)
        for thread in threads:
            thread.join(60)
        assert len(results) == requests, f"{requests - len(results)} requests never returned"
        wrong = {i: r for i, r in results.items() if r != f"echo {i}"}
        assert not wrong, f"{len(wrong)} requests failed or answered wrongly, e.g. {next(iter(wrong.items()))}"

        def restarted() -> dict[str, Any] | None:
            stats = endpoint.stats()
            replicas = stats["components"]["a"]["replicas"]
            return stats if stats["restarts"] >= 1 and len(replicas) == 2 and all(r["alive"] for r in replicas) else None

        stats = _wait_until(restarted, "Ray restarted the killed actor")
        after = [r["pid"] for r in stats["components"]["a"]["replicas"]]
        assert before[0] not in after and before[1] in after
        assert stats["components"]["a"]["methods"]["run"]["retries"] >= 1  # its calls were sent again, not lost
        # Restarted by Ray in place (the front-end process says so), not replaced by a new actor.
        assert "is back: Ray restarted its actor in place (restart 1 of 2)" in capfd.readouterr().err
        assert _free("CPU") == CLUSTER["num_cpus"] - 2
        assert endpoint.query(x=1000) == "echo 1000"


@pytest.mark.ray
@pytest.mark.slow
def test_a_replica_that_cannot_be_placed_fails_deploy_naming_what_is_missing(cluster: str) -> None:
    pipeline = _one(Simulated(0))
    started = time.monotonic()
    with pytest.raises(WorkerDiedError) as failed:
        patchkit.deploy(pipeline, backend="ray", ray_address=cluster, ray_placement_timeout_s=2,
                        ray_actor_options={"a": {"resources": {"node_c": 1}}})
    message = str(failed.value)
    assert "could not be placed" in message and "node_c 1 (the largest node has 0)" in message, message
    assert "ray_placement_timeout_s" in message
    assert time.monotonic() - started < 60
    _wait_until(lambda: _free("CPU") == CLUSTER["num_cpus"], "the unplaced actor was removed")


@pytest.mark.ray
@pytest.mark.slow
def test_idle_replicas_are_retired_and_their_resources_given_back(cluster: str) -> None:
    pipeline = _one(Simulated(0, output=lambda item: -item))
    with patchkit.deploy(pipeline, backend="ray", ray_address=cluster, replicas=3, min_replicas=1, autoscale_interval_s=0.1,
                         scale_down_after_s=0.3) as endpoint:
        assert endpoint.query(x=3) == -3
        _wait_until(lambda: len(_replicas(endpoint, "a")) == 1, "the autoscaler retired the idle replicas")
        _wait_until(lambda: _free("CPU") == CLUSTER["num_cpus"] - 1, "their actors gave their CPUs back")
        assert endpoint.query(x=4) == -4


@pytest.mark.ray
@pytest.mark.slow
def test_a_cluster_address_nobody_answers_at_fails_deploy_at_once() -> None:
    with socket.socket() as probe:  # a port that was free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(patchkit.PatchkitError, match=rf"no Ray cluster answers at 127.0.0.1:{port}.*ray start --head"):
        patchkit.deploy(_one(Simulated(0)), backend="ray", ray_address=f"127.0.0.1:{port}")


def _self_signed(directory: Path) -> tuple[Path, Path]:
    cert, key = directory / "worker.pem", directory / "worker.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=patchkit-worker",
         "-addext", "subjectAltName=DNS:patchkit-worker,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return cert, key


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_tls_between_the_front_end_and_the_workers(cluster: str, tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    pipeline = _one(Simulated(0, output=lambda item: item * 2))
    with patchkit.deploy(pipeline, backend="ray", ray_address=cluster, tls_cert=str(cert), tls_key=str(key),
                         tls_server_name="patchkit-worker") as endpoint:
        assert endpoint.query(x=21) == 42
        address = _replicas(endpoint, "a")[0]["address"]
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(HEALTH)(b"", timeout=10)  # plaintext does not reach a TLS worker
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.ray
@pytest.mark.slow
def test_workers_serve_tls_by_default_and_plaintext_only_when_asked(cluster: str) -> None:
    pipeline = _one(Simulated(0, output=lambda item: item * 2))
    with patchkit.deploy(pipeline, backend="ray", ray_address=cluster) as endpoint:  # no certificate given
        assert endpoint.query(x=21) == 42  # the front-end reaches its workers over TLS, with its own certificate
        address = _replicas(endpoint, "a")[0]["address"]
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(HEALTH)(b"", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # plaintext (and so the secret in it) is refused
    with patchkit.deploy(pipeline, backend="ray", ray_address=cluster, tls=False) as endpoint:
        assert endpoint.query(x=4) == 8
        address = _replicas(endpoint, "a")[0]["address"]
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            channel.unary_unary(HEALTH)(b"", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # plaintext reaches it: only the secret guards


@pytest.mark.ray
@pytest.mark.slow
def test_async_components_serve_on_ray_actors(cluster: str) -> None:
    class Awaiting(patchkit.Component):  # travels to the actor by value, its async setup with it
        async def setup(self) -> None:
            await asyncio.sleep(0)
            self.offset = 10

        @patchkit.make(max_concurrency=16)
        async def add(self, x: int) -> int:
            await asyncio.sleep(0.05)
            return x + self.offset

        @patchkit.make(stream=True)
        async def spell(self, text: str) -> AsyncIterator[str]:
            for letter in text:
                await asyncio.sleep(0)
                yield letter

    awaiting = Awaiting()
    x = 1
    with patchkit.capture(run=False) as pipeline:
        answer = awaiting.spell(str(awaiting.add(x)))  # noqa: F841 - the block's output
    with patchkit.deploy(pipeline, backend="ray", ray_address=cluster) as endpoint, ThreadPoolExecutor(8) as pool:
        assert list(pool.map(lambda value: endpoint.query(x=value), range(8))) == [str(v + 10) for v in range(8)]


def test_an_update_under_load_on_ray_fails_no_request(cluster: str) -> None:
    from versions import Tagger, pids, shout_pipeline, update_under_load

    with patchkit.deploy(shout_pipeline(Tagger("v1"), Tagger("shared")), backend="ray", ray_address=cluster) as endpoint:
        old_pids = pids(endpoint.query(text="a"))
        update_under_load(endpoint)
        assert pids(endpoint.query(text="b"))[1] == old_pids[1]  # the unchanged component kept its actor
        _wait_until(lambda: sorted(endpoint.stats()["components"]) == ["shared", "tagger@v2"], "v1's tagger was stopped")
