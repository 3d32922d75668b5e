"""Updates on a Ray cluster with no room for a second copy of a changed component: a rolling update.

The cluster's CPUs are all held by the deployment, so the new version of the changed component cannot start
beside the old one; its replicas are swapped for the old one's a few at a time (with one replica: once the
requests on the old version have ended), as Ray Serve's rolling update does, and under a steady load no
request fails, each runs wholly on one version, and `/readyz` stays 200.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from versions import Load, Tagger, shout_pipeline, update_under_load, wait_for

import patchkit

if importlib.util.find_spec("ray") is None:
    pytest.skip("needs ray (the ray extra)", allow_module_level=True)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

CPUS = 3


@pytest.fixture(scope="module")
def cluster(ray_environment: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local Ray instance of `CPUS` CPUs for the module, in the session's Ray environment (conftest.py); its address."""
    tmp = tmp_path_factory.mktemp("ray")
    import ray  # after the session's Ray variables: Ray reads some of them once, at import

    ray.init(num_cpus=CPUS, _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=str(tmp / "r"),
             configure_logging=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _free_cpus() -> float:
    import ray

    return float(ray.available_resources().get("CPU", 0.0))


@pytest.mark.parametrize("replicas", [2, 1])
def test_an_update_with_no_room_for_a_second_copy_rolls_its_replicas(cluster: str, replicas: int) -> None:
    # The tagger's replicas and the shared one's hold every CPU of the cluster.
    shared_cpus = CPUS - replicas
    with patchkit.deploy(shout_pipeline(Tagger("v1"), Tagger("shared")), backend="ray", ray_address=cluster,
                         replicas={"tagger": replicas}, ray_actor_options={"shared": {"num_cpus": shared_cpus}},
                         ray_placement_timeout_s=30) as endpoint:
        wait_for(lambda: _free_cpus() == 0)
        update_under_load(endpoint)  # none failed, each wholly one version, none after the switch on the old one
        wait_for(lambda: sorted(endpoint.stats()["components"]) == ["shared", "tagger@v2"], 60)
        wait_for(lambda: len(endpoint.stats()["components"]["tagger@v2"]["replicas"]) == replicas, 60)
        assert endpoint.query(text="Done").startswith("done|v2@")
        assert _free_cpus() == 0


class BrokenTagger(Tagger):
    """A new version of the tagger whose setup fails once `flag` exists: captured before, no worker can start it."""

    def __init__(self, tag: str, flag: str) -> None:
        super().__init__(tag)
        self.flag = flag

    def setup(self) -> None:
        if Path(self.flag).exists():
            raise RuntimeError("the model file is missing")
        super().setup()


@pytest.mark.parametrize("replicas", [2, 1])
def test_a_rolling_update_that_fails_puts_the_old_replicas_back(cluster: str, replicas: int, tmp_path: Path) -> None:
    """The new version's setup fails while requests keep coming: every one is answered, by the version serving."""
    with patchkit.deploy(shout_pipeline(Tagger("v1"), Tagger("shared")), backend="ray", ray_address=cluster,
                         replicas={"tagger": replicas}, ray_actor_options={"shared": {"num_cpus": CPUS - replicas}},
                         ray_placement_timeout_s=30) as endpoint:
        wait_for(lambda: _free_cpus() == 0)
        broken = shout_pipeline(BrokenTagger("v2", str(tmp_path / "flag")), Tagger("shared"))
        (tmp_path / "flag").write_text("")
        with Load(endpoint.url, rate=10.0, threads=4) as load:
            time.sleep(1.0)
            with pytest.raises(patchkit.PatchkitError, match="the model file is missing"):
                endpoint.update(broken)
            time.sleep(1.0)
        assert len(load.records) >= 10
        assert [r for r in load.records if r[2] is None] == []  # none failed
        assert all("|V1@" in str(r[2]) and r[3].startswith("1-") for r in load.records)  # all on the version serving
        assert endpoint.query(text="Still").startswith("STILL|V1@")
        assert [(r["version"], r["state"]) for r in endpoint.pipelines() if r["state"] != "retiring"] == [(1, "ready")]
        wait_for(lambda: sorted(endpoint.stats()["components"]) == ["shared", "tagger"], 60)
        assert len(endpoint.stats()["components"]["tagger"]["replicas"]) == replicas
        wait_for(lambda: _free_cpus() == 0)

