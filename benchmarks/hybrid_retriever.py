"""Hybrid CPU/GPU IVF retriever: hit rates of the hot cache and of lookahead prefetch versus the
resident share, exactness against FAISS IVF, and the search time split.

Synthetic clustered unit vectors; queries pick a cluster with Zipf-skewed popularity and land near
its centre; (original, rewritten) pairs sit close to each other to model pre-retrieval rewriting.

    python benchmarks/hybrid_retriever.py --vectors 200000 --nlist 1024 --nprobe 32 --json hybrid.json --plot hybrid.png

The device tier runs on torch's default device here ("cuda" when present, else "cpu"): on a CPU
the latency figures say what the split costs, not what a GPU gains.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np

from patchkit.components.hybrid.device import pick_device
from patchkit.components.hybrid.index import IvfIndex, build_ivf
from patchkit.components.hybrid.search import HybridSearch

Array = np.ndarray[Any, Any]


def corpus(n: int, dim: int, centres: int, rng: np.random.Generator) -> tuple[Array, Array]:
    means = rng.standard_normal((centres, dim)).astype(np.float32)
    points = means[rng.integers(0, centres, n)] + 0.6 * rng.standard_normal((n, dim)).astype(np.float32)
    return normalise(points), means


def normalise(x: Array) -> Array:
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def skewed_queries(means: Array, count: int, zipf: float, rng: np.random.Generator, noise: float = 0.6) -> Array:
    ranks = (rng.zipf(zipf, count) - 1) % len(means)
    popular = rng.permutation(len(means))[ranks]
    return normalise(means[popular] + noise * rng.standard_normal((count, means.shape[1])).astype(np.float32))


def hot_cache(index: IvfIndex, device: str, share: float, stream: Array, batch: int) -> dict[str, float]:
    total = int(index.cluster_bytes().sum())
    engine = HybridSearch(index, device=device, budget_bytes=int(share * total), cache_share=1.0, refresh_every=4)
    try:
        half = len(stream) // 2
        for start in range(0, half, batch):  # warm up the access counts
            engine.search(stream[start : start + batch], 10)
        engine.wait_idle()
        before = engine.report()
        for start in range(half, len(stream), batch):
            engine.search(stream[start : start + batch], 10)
        after = engine.report()
        hits = after["hit_rate"] * after["queries"] - before["hit_rate"] * before["queries"]
        queries = after["queries"] - before["queries"]
        return {"share": share, "hit_rate": hits / queries, "resident_share": after["resident_share"]}
    finally:
        engine.close()


def lookahead(index: IvfIndex, device: str, share: float, originals: Array, rewritten: Array) -> dict[str, float]:
    total = int(index.cluster_bytes().sum())
    # The whole budget for lookahead, and a generation long enough for the link to fill it.
    engine = HybridSearch(index, device=device, budget_bytes=int(share * total), cache_share=0.0, generation_s=10.0)
    try:
        hits = []
        for original, query in zip(originals, rewritten):
            engine.prefetch(original[None])
            engine.wait_idle()
            before = engine.report()
            engine.search(query[None], 10)
            after = engine.report()
            hits.append(after["hit_rate"] * after["queries"] - before["hit_rate"] * before["queries"])
        report = engine.report()
        return {"share": share, "hit_rate": float(np.mean(hits)), "bytes_prefetched": report["bytes_prefetched"],
                "bytes_prefetched_used": report["bytes_prefetched_used"]}
    finally:
        engine.close()


def timing(raw: Any, index: IvfIndex, device: str, share: float, stream: Array, batch: int, repeats: int) -> dict[str, float]:
    total = int(index.cluster_bytes().sum())
    engine = HybridSearch(index, device=device, budget_bytes=int(share * total), cache_share=1.0, refresh_every=1)
    try:
        for start in range(0, len(stream), batch):
            engine.search(stream[start : start + batch], 10)
        engine.wait_idle()
        queries = stream[:batch]
        raw.nprobe = index.nprobe
        faiss_ms = best_ms(lambda: raw.search(queries, 10), repeats)
        hybrid_ms = best_ms(lambda: engine.search(queries, 10), repeats)
        before = engine.report()
        engine.search(queries, 10)
        after = engine.report()
        d, i = engine.search(queries, 10)
        d0, i0 = raw.search(queries, 10)
        return {
            "share": share, "batch": batch, "faiss_cpu_ms": faiss_ms, "hybrid_ms": hybrid_ms,
            "cpu_part_ms": 1000 * (after["cpu_search_s"] - before["cpu_search_s"]),
            "device_part_ms": 1000 * (after["device_search_s"] - before["device_search_s"]),
            "same_ids": float((i == i0).all(axis=1).mean()), "max_distance_error": float(np.abs(d - d0).max()),
        }
    finally:
        engine.close()


def best_ms(fn: Any, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vectors", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--nlist", type=int, default=1024)
    parser.add_argument("--nprobe", type=int, default=32)
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--queries", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--device", default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    device = pick_device(args.device)
    vectors, means = corpus(args.vectors, args.dim, args.nlist, rng)
    start = time.perf_counter()
    raw = build_ivf(vectors, nlist=args.nlist)
    took = time.perf_counter() - start
    print(f"built IVF{args.nlist} over {args.vectors} x {args.dim} in {took:.0f} s; device tier on {device}")
    index = IvfIndex(raw, nprobe=args.nprobe)
    stream = skewed_queries(means, args.queries, args.zipf, rng)
    originals = skewed_queries(means, args.pairs, args.zipf, rng)
    rewritten = normalise(originals + 0.25 * rng.standard_normal(originals.shape).astype(np.float32))
    shares = (0.05, 0.1, 0.25, 0.5)
    results: dict[str, Any] = {"config": vars(args) | {"device": device}}
    results["hot_cache"] = [hot_cache(index, device, s, stream, 32) for s in shares]
    results["lookahead"] = [lookahead(index, device, s, originals, rewritten) for s in (0.01, 0.02, 0.05, 0.1)]
    results["timing"] = [timing(raw, index, device, 0.25, stream, b, 5) for b in (1, 32)]
    for row in results["hot_cache"]:
        print(f"hot cache   share {row['share']:.2f}: hit rate {row['hit_rate']:.3f}")
    for row in results["lookahead"]:
        print(f"lookahead   share {row['share']:.2f}: hit rate {row['hit_rate']:.3f}")
    for row in results["timing"]:
        print(f"batch {row['batch']:>2}, 25% resident: FAISS {row['faiss_cpu_ms']:.2f} ms, hybrid {row['hybrid_ms']:.2f} ms "
              f"(CPU part {row['cpu_part_ms']:.2f}, device part {row['device_part_ms']:.2f}); same ids {row['same_ids']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot:
        plot(results, args.plot)


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in ("hot_cache", "lookahead"):
        rows = results[name]
        ax.plot([100 * r["share"] for r in rows], [r["hit_rate"] for r in rows], marker="o", label=name.replace("_", " "))
    ax.set_xlabel("share of the index resident (%)")
    ax.set_ylabel("probes hit on the device")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
