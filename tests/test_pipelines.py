"""Several pipelines on one deployment, and updates while it serves.

Each pipeline is served at its own route and as `endpoint[name]`; a component object two pipelines use is
deployed once and batches the calls of both; `endpoint.update` starts what changed before it switches, keeps
the workers of what did not, lets requests in flight end on their version, and changes nothing when it fails.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from versions import Load, Tagger, alive, pids, refusing_pipeline, shout_pipeline, update_under_load, wait_for, whisper_pipeline

import patchkit
from patchkit.errors import ConfigError, InputError, PatchkitError, PipelineNotFound

BACKENDS = ["local", "inprocess"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_two_pipelines_each_at_its_route_sharing_one_component(backend: str, tmp_path: Path) -> None:
    log = tmp_path / "shared.log"
    shared = Tagger("shared", str(log), delay_s=0.05)
    shout, whisper = shout_pipeline(Tagger("s"), shared), whisper_pipeline(Tagger("w"), shared)
    with patchkit.deploy({"shout": shout, "whisper": whisper}, backend=backend, batch_wait_ms=20) as endpoint:
        loud, quiet = endpoint["shout"].query(text="Ada"), endpoint["whisper"].query(text="Bo")
        assert loud.startswith("ADA|S@") and loud.split("|")[2].startswith("SHARED@")
        assert quiet.startswith("bo|w@") and quiet.split("|")[2].startswith("shared@")
        assert pids(loud)[1] == pids(quiet)[1]  # one set of workers for the shared component

        listed = {row["name"]: row for row in endpoint.pipelines()}
        assert set(listed) == {"shout", "whisper"}
        assert listed["shout"]["version"] == 1 and listed["shout"]["state"] == "ready"
        assert listed["shout"]["inputs"] == ["text"]
        components = endpoint.stats()["components"]
        assert sorted(components) == ["shared", "tagger", "whisper/tagger"]  # the shared one once

        with pytest.raises(InputError, match="several pipelines"):
            endpoint.query(text="x")  # /v1/query: which one?
        with pytest.raises(PipelineNotFound, match="shout, whisper"):
            endpoint["nope"].query(text="x")

        # Calls of both pipelines share the shared component's batches.
        log.write_text("")
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            words = [f"w{i}" for i in range(16)]
            futures = [pool.submit(endpoint["shout" if i % 2 else "whisper"].query, text=w) for i, w in enumerate(words)]
            answers = [f.result() for f in futures]
        assert [a.split("|")[0].lower() for a in answers] == words
        batches = [json.loads(line) for line in log.read_text().splitlines()]
        assert any({t.split("|")[1][0] for t in batch} == {"s", "w"} for batch in batches), batches


def test_openai_models_are_the_pipelines(tmp_path: Path) -> None:
    shared = Tagger("shared")
    pipelines = {"shout": shout_pipeline(Tagger("s"), shared), "whisper": whisper_pipeline(Tagger("w"), shared)}
    with patchkit.deploy(pipelines, backend="inprocess") as endpoint:
        models = httpx.get(f"{endpoint.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == ["shout", "whisper"]
        reply = httpx.post(f"{endpoint.url}/v1/chat/completions",
                           json={"model": "whisper", "messages": [{"role": "user", "content": "Hi There"}]}).json()
        assert reply["model"] == "whisper" and reply["choices"][0]["message"]["content"].startswith("hi there|w@")
        missing = httpx.post(f"{endpoint.url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
        assert missing.status_code == 400 and "name one as model" in missing.json()["error"]["message"]


def test_update_keeps_unchanged_workers_and_starts_changed_ones_first(backend: str) -> None:
    shared = Tagger("shared")
    with patchkit.deploy(shout_pipeline(Tagger("v1"), shared), backend=backend) as endpoint:
        before = endpoint.query(text="a")
        assert before.startswith("A|V1@")
        # The script runs again: new objects, the shared one as it was, the other with a new argument, new code.
        versions = endpoint.update(whisper_pipeline(Tagger("v2"), Tagger("shared")))
        assert [(v["name"], v["version"]) for v in versions.values()] == [("patchkit", 2)]
        after = endpoint.query(text="B")
        assert after.startswith("b|v2@")
        assert pids(after)[1] == pids(before)[1]  # the shared component kept its worker (and its caches)
        if backend == "local":
            assert pids(after)[0] != pids(before)[0]  # the changed one runs in a new one
        listed = endpoint.pipelines()
        assert [(row["version"], row["state"]) for row in listed if row["state"] != "retiring"] == [(2, "ready")]
        wait_for(lambda: sorted(endpoint.stats()["components"]) == ["shared", "tagger@v2"])  # v1's tagger stopped


def test_a_request_runs_wholly_on_the_version_it_started_on(backend: str) -> None:
    shared = Tagger("shared", delay_s=1.0)
    with patchkit.deploy(shout_pipeline(Tagger("v1"), shared), backend=backend) as endpoint:
        url = endpoint.url
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            started = pool.submit(httpx.post, f"{url}/v1/query", json={"inputs": {"text": "old"}}, timeout=30)
            time.sleep(0.3)  # it is at the shared component, which takes a second
            endpoint.update(whisper_pipeline(Tagger("v2"), shared))
            reply = started.result()
        assert reply.json()["output"].startswith("OLD|V1@")  # v1's code ran after the switch: upper()
        assert reply.headers["X-Pipeline-Version"].startswith("1-")
        new = httpx.post(f"{url}/v1/query", json={"inputs": {"text": "New"}}, timeout=30)
        assert new.json()["output"].startswith("new|v2@") and new.headers["X-Pipeline-Version"].startswith("2-")


def test_a_failed_update_changes_nothing(tmp_path: Path) -> None:
    shared = Tagger("shared")
    with patchkit.deploy(shout_pipeline(Tagger("v1"), shared)) as endpoint:  # local: workers of their own
        with pytest.raises(PatchkitError, match="the model file is missing"):
            endpoint.update(refusing_pipeline(shared, tmp_path / "flag"))
        assert endpoint.query(text="still").startswith("STILL|V1@")
        assert [(r["version"], r["state"]) for r in endpoint.pipelines()] == [(1, "ready")]
        assert sorted(endpoint.stats()["components"]) == ["shared", "tagger"]
        with pytest.raises(ConfigError, match="a Pipeline"):
            endpoint.update({"other": "not a pipeline"})  # type: ignore[dict-item]


def test_add_and_remove_pipelines_while_serving(backend: str) -> None:
    shared = Tagger("shared")
    with patchkit.deploy({"shout": shout_pipeline(Tagger("s"), shared)}, backend=backend) as endpoint:
        endpoint.update({"whisper": whisper_pipeline(Tagger("w"), shared)})
        assert endpoint["whisper"].query(text="Hi").startswith("hi|w@")
        endpoint.remove("shout")
        with pytest.raises(PipelineNotFound):
            endpoint["shout"].query(text="x")
        assert endpoint["whisper"].query(text="Yo").startswith("yo|w@")
        wait_for(lambda: sorted(endpoint.stats()["components"]) == ["shared", "whisper/tagger"])
        with pytest.raises(ConfigError, match="at least one pipeline"):
            endpoint.remove("whisper")


def test_pipeline_names_are_checked() -> None:
    with pytest.raises(ConfigError, match="name"):
        patchkit.deploy({"bad name/": shout_pipeline(Tagger("s"), Tagger("x"))}, backend="inprocess")


def test_updates_from_threads_serialise(tmp_path: Path) -> None:
    shared = Tagger("shared")
    with patchkit.deploy({"a": shout_pipeline(Tagger("a0"), shared)}, backend="inprocess") as endpoint:
        errors: list[BaseException] = []

        def update(i: int) -> None:
            try:
                endpoint.update({"a": shout_pipeline(Tagger(f"a{i}"), shared)})
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

        threads = [threading.Thread(target=update, args=(i,)) for i in range(1, 4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors
        assert [row["version"] for row in endpoint.pipelines() if row["state"] != "retiring"] == [4]


def test_an_update_under_load_fails_no_request_and_serves_no_stale_answer() -> None:
    shared = Tagger("shared")
    with patchkit.deploy(shout_pipeline(Tagger("v1"), shared)) as endpoint:  # the default backend
        old_pids = pids(endpoint.query(text="a"))
        update_under_load(endpoint)
        new_pids = pids(endpoint.query(text="b"))
        assert new_pids[1] == old_pids[1]  # the unchanged component kept its worker
        wait_for(lambda: not alive(int(old_pids[0])))  # the old version's own worker is gone


def test_a_failed_update_under_load_fails_no_request(tmp_path: Path) -> None:
    shared = Tagger("shared")
    with patchkit.deploy(shout_pipeline(Tagger("v1"), shared)) as endpoint:
        with Load(endpoint.url) as load:
            time.sleep(1.0)
            with pytest.raises(PatchkitError, match="the model file is missing"):
                endpoint.update(refusing_pipeline(shared, tmp_path / "flag"))
            time.sleep(1.0)
        assert [r for r in load.records if r[2] is None] == []
        assert all(r[2] is not None and r[2].startswith("LOAD") and "|V1@" in r[2] for r in load.records)


def test_a_pipeline_of_higher_priority_goes_first_in_the_queues_it_shares(tmp_path: Path) -> None:
    log = tmp_path / "shared.log"
    shared = Tagger("shared", str(log), delay_s=0.2)
    pipelines = {"bulk": shout_pipeline(Tagger("b"), shared), "urgent": whisper_pipeline(Tagger("u"), shared)}
    options = {"batch_size": {"shared": 1}, "max_inflight_batches": 1, "priority": {"urgent": 1}}
    with patchkit.deploy(pipelines, backend="inprocess", **options) as endpoint:
        log.write_text("")
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            bulk = [pool.submit(endpoint["bulk"].query, text=f"bulk{i}") for i in range(6)]
            time.sleep(0.3)  # the first bulk call runs, the others wait in the shared queue
            urgent = pool.submit(endpoint["urgent"].query, text="URGENT")
            assert urgent.result().startswith("urgent|u@") and all(f.result() for f in bulk)
        order = [json.loads(line)[0].split("|")[0] for line in log.read_text().splitlines()]
        assert order.index("URGENT") <= 2, order  # ahead of the 3 or more bulk calls queued before it


def test_each_pipeline_has_its_slo_and_its_counts_in_metrics_stats_and_traces() -> None:
    shared = Tagger("shared")
    pipelines = {"shout": shout_pipeline(Tagger("s"), shared), "whisper": whisper_pipeline(Tagger("w"), shared)}
    with patchkit.deploy(pipelines, backend="inprocess", slo_ms={"shout": 5000}) as endpoint:
        endpoint["shout"].query(text="a")
        endpoint["whisper"].query(text="b")
        endpoint["whisper"].query(text="c")
        traced = [trace.pipeline for trace in endpoint.traces()]
        assert traced == ["shout"]  # only shout's requests have an SLO, and their traces say whose they are
        counts = endpoint.stats()["pipelines"]
        assert {name: sum(n["ok"] for n in versions.values()) for name, versions in counts.items()} == {"shout": 1, "whisper": 2}
        metrics = httpx.get(f"{endpoint.url}/metrics").text
        whisper_version = next(row["digest"] for row in endpoint.pipelines() if row["name"] == "whisper")
        assert f'patchkit_pipeline_requests_total{{outcome="ok",pipeline="whisper",version="1-{whisper_version}"}} 2.0' in metrics
    with pytest.raises(ConfigError, match="slo_ms names 'nope'"):
        patchkit.deploy(pipelines, backend="inprocess", slo_ms={"nope": 100})


@pytest.mark.slow
def test_deploy_plans_several_pipelines_as_one_with_their_weights() -> None:
    shared = Tagger("shared")
    pipelines = {"shout": shout_pipeline(Tagger("s"), shared), "whisper": whisper_pipeline(Tagger("w"), shared)}
    with patchkit.deploy(pipelines, backend="inprocess", plan="auto", weights={"shout": 3, "whisper": 1},
                         resources={"cpu": 2}) as endpoint:
        applied = endpoint.plan()["plan"]
        assert applied["weights"] == {"shout": 0.75, "whisper": 0.25}
        assert sorted(applied["components"]) == ["shared", "tagger", "whisper/tagger"]
        assert endpoint["whisper"].query(text="Hi").startswith("hi|w@")
    with pytest.raises(ConfigError, match="weights= is for planning"):
        patchkit.deploy(pipelines, backend="inprocess", weights={"shout": 1, "whisper": 1})
