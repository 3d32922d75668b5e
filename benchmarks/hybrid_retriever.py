"""Hybrid CPU/GPU IVF retriever: hit rates of the hot cache and of lookahead prefetch versus the
resident share, exactness against FAISS IVF, and the search time split.

Synthetic clustered unit vectors; queries pick a cluster with Zipf-skewed popularity and land near
its centre; (original, rewritten) pairs sit close to each other to model pre-retrieval rewriting.

    python benchmarks/hybrid_retriever.py --vectors 200000 --nlist 1024 --nprobe 32,64 --json hybrid.json --plot hybrid.png

The index is built once and measured at every nprobe given. The device tier runs on torch's default
device here ("cuda" when present, else "cpu"): on a CPU the latency figures say what the split
costs, not what a GPU gains. Latency per batch (the mean over `--repeats` batches of the stream)
is timed at 25% of the index resident (hot clusters) and with the whole index resident (the device
alone), against FAISS IVF on the CPU in the same run, at both of FAISS's parallel modes (over
queries, its default and FaissRetriever's; over one query's lists, the hybrid's CPU part): the
faster of the two is the baseline.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from patchkit.components.hybrid.device import pick_device
from patchkit.components.hybrid.index import IvfIndex, build_ivf, load_ivf
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
    """Mean latency over `repeats` batches from the first half of `stream`, the tier settled on the hot
    set of its second half (the whole index when `share` is 1) and left as it is while timing."""
    total = int(index.cluster_bytes().sum())
    engine = HybridSearch(index, device=device, budget_bytes=int(share * total), cache_share=1.0, refresh_every=4)
    try:
        half = len(stream) // 2
        for start in range(half, len(stream), 32):
            engine.search(stream[start : start + 32], 10)
        engine.refresh()  # the hot set of the whole warm-up
        engine.wait_idle()
        engine.refresh_every = 1 << 62  # settled: no move runs beside the timed searches
        if share >= 1:  # every cluster, probed in the warm-up or not
            engine.tier.install(range(index.nlist))
        batches = [stream[j * batch : (j + 1) * batch] for j in range(repeats)]
        by_queries, by_lists = faiss_ms(raw, batches)
        engine.search(batches[0], 10)  # warm-up
        before = engine.report()
        hybrid_ms = mean_ms(lambda queries: engine.search(queries, 10), batches)
        after = engine.report()
        found = [engine.search(queries, 10) for queries in batches]
        expected = [raw.search(queries, 11) for queries in batches]  # one more: shows a tie at the 10th place
        same = np.concatenate([(i == i0[:, :10]).all(axis=1) for (_, i), (_, i0) in zip(found, expected)])
        untied = sum(untied_mismatches(d, i, d0, i0) for (d, i), (d0, i0) in zip(found, expected))
        error = max(float(np.abs(d - d0[:, :10]).max()) for (d, _), (d0, _) in zip(found, expected))
        timed = after["queries"] - before["queries"]
        return {
            "share": share, "batch": batch, "faiss_cpu_ms": min(by_queries, by_lists),
            "faiss_over_queries_ms": by_queries, "faiss_over_lists_ms": by_lists, "hybrid_ms": hybrid_ms,
            "speedup": min(by_queries, by_lists) / hybrid_ms,
            "hit_rate": (after["hit_rate"] * after["queries"] - before["hit_rate"] * before["queries"]) / timed,
            "cpu_part_ms": 1000 * (after["cpu_search_s"] - before["cpu_search_s"]) / repeats,
            "device_part_ms": 1000 * (after["device_search_s"] - before["device_search_s"]) / repeats,
            "same_ids": float(same.mean()), "untied_mismatches": untied, "max_distance_error": error,
        }
    finally:
        engine.close()


def untied_mismatches(d: Array, i: Array, d0: Array, i0: Array, tol: float = 1e-5) -> int:
    """Queries whose ids differ from FAISS's (`d0`, `i0`: one column more) at a place whose distance is
    not within `tol` of a neighbour's: a difference that float error between two exact searches cannot explain."""
    k = d.shape[1]
    gaps = np.abs(np.diff(np.concatenate([np.full((len(d0), 1), np.inf), d0], axis=1), axis=1))
    distinct = (gaps[:, :k] > tol) & (gaps[:, 1 : k + 1] > tol)
    return int(((i != i0[:, :k]) & distinct).any(axis=1).sum())


def faiss_ms(raw: Any, batches: list[Array]) -> tuple[float, float]:
    """FAISS's own mean search time over `batches` at the index's nprobe, parallel over queries (mode 0,
    FAISS's default) and over each query's lists (mode 1, which `IvfIndex` sets for the hybrid's CPU part)."""
    mode = raw.parallel_mode
    try:
        times = []
        for parallel_mode in (0, 1):
            raw.parallel_mode = parallel_mode
            raw.search(batches[0], 10)  # warm-up
            times.append(mean_ms(lambda queries: raw.search(queries, 10), batches))
        return times[0], times[1]
    finally:
        raw.parallel_mode = mode


def mean_ms(search: Any, batches: list[Array]) -> float:
    start = time.perf_counter()
    for queries in batches:
        search(queries)
    return 1000 * (time.perf_counter() - start) / len(batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vectors", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--nlist", type=int, default=1024)
    parser.add_argument("--nprobe", default="32", help="one or more, comma-separated: each is measured on the same index")
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--queries", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=20, help="batches each latency figure is the mean of")
    parser.add_argument("--timing-only", action="store_true", help="skip the hit-rate sweeps: latency and exactness only")
    parser.add_argument("--device", default=None)
    parser.add_argument("--index", default=None, help="read the IVF index from this file when it exists, else build and write it")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    device = pick_device(args.device)
    vectors, means = corpus(args.vectors, args.dim, args.nlist, rng)
    start = time.perf_counter()
    raw = ivf(vectors, args.nlist, args.index)
    took = time.perf_counter() - start
    print(f"IVF{args.nlist} over {args.vectors} x {args.dim} ready in {took:.0f} s; {machine(device)}")
    stream = skewed_queries(means, args.queries, args.zipf, rng)
    originals = skewed_queries(means, args.pairs, args.zipf, rng)
    rewritten = normalise(originals + 0.25 * rng.standard_normal(originals.shape).astype(np.float32))
    results: dict[str, Any] = {"config": vars(args) | {"device": device, "machine": machine(device), "build_s": took}, "runs": []}
    for nprobe in (int(x) for x in args.nprobe.split(",")):
        index = IvfIndex(raw, nprobe=nprobe)
        run: dict[str, Any] = {"nprobe": nprobe, "hot_cache": [], "lookahead": []}
        if not args.timing_only:
            run["hot_cache"] = [hot_cache(index, device, s, stream, 32) for s in (0.05, 0.1, 0.25, 0.5)]
            run["lookahead"] = [lookahead(index, device, s, originals, rewritten) for s in (0.01, 0.02, 0.05, 0.1)]
        run["timing"] = [timing(raw, index, device, s, stream, b, args.repeats) for s in (0.25, 1.0) for b in (1, 32)]
        results["runs"].append(run)
        report(run)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    if args.plot:
        plot(results, args.plot)


def ivf(vectors: Array, nlist: int, path: str | None) -> Any:
    """The IVF index of `vectors`: read from `path` when it holds one of theirs (same seed, same corpus), else built."""
    import faiss

    if path is not None and Path(path).is_file():
        raw = load_ivf(path)
        if raw.ntotal == len(vectors) and raw.nlist == nlist and raw.d == vectors.shape[1]:
            return raw
    raw = build_ivf(vectors, nlist=nlist)
    if path is not None:
        faiss.write_index(raw, path)
    return raw


def machine(device: str) -> str:
    """The device tier's device and the CPU threads FAISS uses, for the results' header."""
    import faiss
    import torch

    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "torch's CPU device"
    return f"device tier on {device} ({name}); FAISS on {faiss.omp_get_max_threads()} threads"


def report(run: dict[str, Any]) -> None:
    print(f"nprobe {run['nprobe']}")
    for row in run["hot_cache"]:
        print(f"  hot cache   share {row['share']:.2f}: hit rate {row['hit_rate']:.3f}")
    for row in run["lookahead"]:
        print(f"  lookahead   share {row['share']:.2f}: hit rate {row['hit_rate']:.3f}")
    for row in run["timing"]:
        print(f"  batch {row['batch']:>2}, {row['share']:.0%} resident (hit rate {row['hit_rate']:.2f}): FAISS "
              f"{row['faiss_cpu_ms']:.2f} ms (over queries {row['faiss_over_queries_ms']:.2f}, over lists "
              f"{row['faiss_over_lists_ms']:.2f}), hybrid {row['hybrid_ms']:.2f} ms = {row['speedup']:.2f}x "
              f"(CPU part {row['cpu_part_ms']:.2f}, device part {row['device_part_ms']:.2f}); same ids "
              f"{row['same_ids']:.3f} (differing beyond ties: {row['untied_mismatches']}), max distance error "
              f"{row['max_distance_error']:.1e}")


def plot(results: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for run in results["runs"]:
        for name in ("hot_cache", "lookahead"):
            rows = run[name]
            ax.plot([100 * r["share"] for r in rows], [r["hit_rate"] for r in rows], marker="o",
                    label=f"{name.replace('_', ' ')}, nprobe {run['nprobe']}")
    ax.set_xlabel("share of the index resident (%)")
    ax.set_ylabel("probes hit on the device")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
