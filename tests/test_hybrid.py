"""The hybrid CPU/GPU IVF retriever's parts on small synthetic vectors: the device tier runs on
torch's CPU device here (the same code a GPU runs), and its answers equal plain FAISS IVF."""

from __future__ import annotations

import threading
from importlib.util import find_spec
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from patchkit.components import HybridIVFRetriever
from patchkit.components.hybrid.budget import CpuLatencyModel, choose_share, fit_beta, hit_rates, tail_hit_rate
from patchkit.components.hybrid.cache import ClusterHeat, Lookahead, desired, fill
from patchkit.components.hybrid.index import IvfIndex, build_ivf
from patchkit.components.hybrid.merge import merge_topk
from patchkit.components.hybrid.search import HybridSearch

Array = np.ndarray[Any, Any]
# The index is FAISS's IVF and the device tier is torch code, here on torch's CPU device.
needs_faiss = pytest.mark.skipif(find_spec("faiss") is None, reason="builds a FAISS IVF index: pip install -e '.[retrieval]'")
needs_torch = pytest.mark.skipif(find_spec("torch") is None, reason="the device tier runs torch: pip install -e '.[retrieval]'")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def engine(vectors: Array, *, nlist: int, nprobe: int, metric: str = "ip", share: float = 1.0, device: str = "cpu",
           **options: Any) -> tuple[Any, HybridSearch]:
    raw = build_ivf(vectors, nlist=nlist, metric=metric)
    index = IvfIndex(raw, nprobe=nprobe)
    budget = int(index.cluster_bytes().sum() * share)
    return raw, HybridSearch(index, device=device, budget_bytes=budget, bandwidth_bps=1e9, **options)


def plain_ivf(raw: Any, queries: Array, k: int, nprobe: int) -> tuple[Array, Array]:
    """FAISS's own IVF search, one result longer than asked: the extra one shows ties at the k-th place."""
    raw.nprobe = nprobe
    return raw.search(queries, k + 1)


def assert_same_topk(d: Array, i: Array, d0: Array, i0: Array, tol: float = 1e-4) -> None:
    """Distances equal FAISS's (`d0`, `i0`: k + 1 columns) within float error; ids equal wherever a
    distance is not tied with a neighbour (tied ids may come in either order, or either may win)."""
    k = d.shape[1]
    np.testing.assert_allclose(d, d0[:, :k], rtol=1e-5, atol=tol)
    for row_i, row_d0, row_i0 in zip(i, d0, i0):
        gaps = np.abs(np.diff(np.concatenate([[np.inf], row_d0])))  # gaps[j]: between place j - 1 and j
        distinct = (gaps[:k] > tol) & (gaps[1 : k + 1] > tol)
        np.testing.assert_array_equal(row_i[distinct], row_i0[:k][distinct])


# Random data, index shapes, metrics, exact ties and resident sets: the cases a search must answer as FAISS does.
cache_states = given(
    n=st.integers(40, 400), dim=st.integers(2, 12), nlist=st.integers(1, 12), k=st.integers(1, 25),
    metric=st.sampled_from(["ip", "l2"]), duplicates=st.booleans(), seed=st.integers(0, 2**16), data=st.data(),
)


@needs_faiss
@needs_torch
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@cache_states
def test_every_cache_state_answers_as_plain_ivf(
    n: int, dim: int, nlist: int, k: int, metric: str, duplicates: bool, seed: int, data: st.DataObject
) -> None:
    check_cache_state("cpu", n, dim, nlist, k, metric, duplicates, seed, data)


@pytest.mark.gpu
@needs_faiss
@needs_torch
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@cache_states
def test_every_cache_state_on_cuda_answers_as_plain_ivf(
    n: int, dim: int, nlist: int, k: int, metric: str, duplicates: bool, seed: int, data: st.DataObject
) -> None:
    check_cache_state("cuda", n, dim, nlist, k, metric, duplicates, seed, data)


def check_cache_state(
    device: str, n: int, dim: int, nlist: int, k: int, metric: str, duplicates: bool, seed: int, data: st.DataObject
) -> None:
    rng = np.random.default_rng(seed)
    vectors = rng.standard_normal((n, dim)).astype(np.float32)
    if duplicates:  # exact ties between ids
        vectors[n // 2 :] = vectors[: n - n // 2]
    nlist = min(nlist, n // 20)  # FAISS's k-means wants points per centroid
    nprobe = data.draw(st.integers(1, nlist), label="nprobe")
    raw, hybrid = engine(vectors, nlist=nlist, nprobe=nprobe, metric=metric, device=device)
    try:
        resident = data.draw(st.lists(st.integers(0, nlist - 1), unique=True), label="resident clusters")
        hybrid.tier.install(resident)
        queries = np.concatenate([rng.standard_normal((5, dim)), vectors[:3]]).astype(np.float32)
        d, i = hybrid.search(queries, k)
        assert_same_topk(d, i, *plain_ivf(raw, queries, k, nprobe))
    finally:
        hybrid.close()


@pytest.fixture(scope="module")
def clustered() -> Array:
    rng = np.random.default_rng(7)
    centres = rng.standard_normal((40, 16)) * 4
    points = centres[rng.integers(0, 40, 6000)] + rng.standard_normal((6000, 16))
    return (points / np.linalg.norm(points, axis=1, keepdims=True)).astype(np.float32)


@needs_faiss
@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_hot_clusters_become_resident_and_are_hit(clustered: Array, device: str) -> None:
    raw, hybrid = engine(clustered, nlist=40, nprobe=4, share=0.3, refresh_every=2, device=device)
    try:
        queries = clustered[np.argsort(-clustered @ clustered[0])[:20]]  # one popular region, again and again
        for _ in range(6):
            d, i = hybrid.search(queries, 5)
            hybrid.wait_idle()
        assert_same_topk(d, i, *plain_ivf(raw, queries, 5, 4))
        report = hybrid.report()
        assert report["refreshes"] >= 1 and report["resident_share"] <= 0.3
        assert report["hit_rate"] > 0.5  # the region's clusters fit the budget: every batch after the first refresh hits
        assert report["cpu_search_s"] > 0 and report["device_search_s"] > 0
    finally:
        hybrid.close()


@needs_faiss
@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_a_search_never_waits_for_a_move(clustered: Array, device: str) -> None:
    raw, hybrid = engine(clustered, nlist=40, nprobe=4, share=0.5, device=device)
    try:
        queries = clustered[:64]
        hybrid.heat.observe(hybrid.index.assign(queries)[1])
        with hybrid.tier._install_lock:  # a move is stuck copying: searches go on, the CPU covering its clusters
            moving = hybrid.refresh()
            result: list[tuple[Array, Array]] = []
            searcher = threading.Thread(target=lambda: result.append(hybrid.search(queries, 5)))
            searcher.start()
            searcher.join(timeout=30)
            assert result and not moving.done()
        hybrid.wait_idle()
        assert_same_topk(*result[0], *plain_ivf(raw, queries, 5, 4))
        assert hybrid.report()["resident_clusters"] > 0
    finally:
        hybrid.close()


@needs_faiss
@needs_torch
@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_makes_the_nearby_query_hit(clustered: Array, device: str) -> None:
    raw, hybrid = engine(clustered, nlist=40, nprobe=4, share=0.4, cache_share=0.0, generation_s=1.0, device=device)
    try:
        rng = np.random.default_rng(1)
        original = clustered[5:6]
        rewritten = original + 0.05 * rng.standard_normal(original.shape).astype(np.float32)
        asked = hybrid.prefetch(original)
        assert 0 < asked <= hybrid.prefetch_budget()
        hybrid.wait_idle()
        hybrid.search(rewritten, 5)
        report = hybrid.report()
        assert report["bytes_prefetched"] == asked and report["bytes_prefetched_used"] > 0
        assert report["lookahead_hit_rate"] > 0
    finally:
        hybrid.close()


def test_merge_is_exact_and_fills_like_faiss() -> None:
    worst = float(-np.finfo(np.float32).max)
    a = (np.array([[0.9, 0.5, worst]], np.float32), np.array([[1, 2, -1]]))
    b = (np.array([[0.7, 0.6, 0.1]], np.float32), np.array([[3, 4, 5]]))
    d, i = merge_topk([a, b], 4, larger_is_better=True, worst=worst)
    assert i.tolist() == [[1, 3, 4, 2]] and d[0, 0] == np.float32(0.9)
    d, i = merge_topk([a], 5, larger_is_better=True, worst=worst)
    assert i.tolist() == [[1, 2, -1, -1, -1]] and d[0, -1] == np.float32(worst)


def test_heat_decays_and_ranks_hottest_first() -> None:
    heat = ClusterHeat(5, decay=0.5)
    heat.observe(np.array([[0, 1]]))
    heat.observe(np.array([[2, 2], [2, -1]]))
    assert heat.ranking().tolist() == [2, 0, 1]
    assert fill([2, 0, 1], np.array([10, 10, 30, 0, 0]), 35) == [2]
    assert desired([2], [0, 1, 2], np.array([10, 10, 30, 0, 0]), cache_bytes=30, total_bytes=45) == [2, 0]


def test_lookahead_expires_and_reports_first_use_only() -> None:
    now = [0.0]
    ahead = Lookahead(ttl_s=2.0, clock=lambda: now[0])
    ahead.add([3, 4])
    now[0] = 1.0
    assert ahead.first_use([3, 9]) == [(3, 1.0)] and ahead.first_use([3]) == []
    now[0] = 3.5
    ahead.expire()
    assert ahead.newest_first() == []


def test_slo_budget_grows_as_the_slo_tightens() -> None:
    rng = np.random.default_rng(3)
    sizes = np.full(100, 1000)
    popular = rng.zipf(1.5, size=(400, 8)) % 100  # skewed cluster popularity
    model = CpuLatencyModel(fixed_ms=0.5, per_vector_ms=1e-4)
    loose = choose_share(popular, sizes, 100, model, slo_ms=1000, batch=8)
    tight = choose_share(popular, sizes, 100, model, slo_ms=3.0, batch=8)
    impossible = choose_share(popular, sizes, 100, model, slo_ms=0.1, batch=8)
    assert loose.share == 0 and loose.meets_slo
    assert 0 < tight.share < 1 and tight.meets_slo and tight.predicted_ms <= 3.0
    assert tight.budget_bytes <= tight.share * sizes.sum() * 100 + 1
    assert impossible.share == 1.0  # only the whole index resident leaves the CPU nothing to do


def test_tail_hit_rate_falls_with_batch_size() -> None:
    a, b = fit_beta(np.array([0.6, 0.7, 0.8, 0.9, 0.75]))
    assert 0.6 < a / (a + b) < 0.8
    assert tail_hit_rate(a, b, 32) < tail_hit_rate(a, b, 1) < a / (a + b)
    assert hit_rates(np.array([[0, 1, -1]]), np.array([1, 3]), np.array([True, False])).tolist() == [0.25]
    assert CpuLatencyModel.fit([(0, 1.0), (100, 2.0)]).predict(50) == pytest.approx(1.5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"gpu_budget": "half"}, "gpu_budget must be"),
        ({"gpu_budget": "slo"}, "needs search_slo_ms"),
        ({"gpu_budget": 1.5}, "share must be in"),
        ({"gpu_budget": 0.5, "search_slo_ms": 10}, "applies only with gpu_budget='slo'"),
        ({"nprobe": 0}, "nprobe must be"),
    ],
)
def test_bad_options_are_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HybridIVFRetriever(["some text"], **options)


@needs_faiss
def test_index_checks_nprobe_against_nlist(clustered: Array) -> None:
    with pytest.raises(ValueError, match=r"nprobe \(50\) must be between 1 and the index's nlist \(40\)"):
        IvfIndex(build_ivf(clustered, nlist=40), nprobe=50)


@pytest.mark.gpu
@needs_faiss
@needs_torch
def test_cuda_tier_answers_as_plain_ivf(clustered: Array) -> None:
    raw, hybrid = engine(clustered, nlist=40, nprobe=8, share=0.5, device="cuda", refresh_every=1)
    try:
        queries = clustered[:256]
        for _ in range(3):
            d, i = hybrid.search(queries, 10)
            hybrid.wait_idle()
        assert_same_topk(d, i, *plain_ivf(raw, queries, 10, 8))
        report = hybrid.report()
        assert report["device"].startswith("cuda") and report["hit_rate"] > 0
        assert hybrid.tier.store.vectors.is_pinned()
    finally:
        hybrid.close()
