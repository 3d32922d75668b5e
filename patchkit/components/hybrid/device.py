"""The device tier: the vectors of the resident clusters as torch tensors, searched with a batched
matrix product and a top-k.

The resident set is an immutable `Residency`: one slab of rows, contiguous per cluster, within a
fixed byte budget. A change builds a new slab (keeping the rows of clusters that stay, copying the
new ones from the host store) and publishes it with one reference assignment, so a search never
waits for a change: it keeps the snapshot it started with, and a cluster still on its way is not in
it, so that search covers it on the CPU.

The same code runs on any torch device. On "cuda" new clusters come from pinned host memory with
asynchronous copies on a stream of their own; on "cpu" (how the tier is tested on machines without
a GPU) the copies are plain memory copies and every line of the search is the one a GPU runs.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from patchkit.components.hybrid.index import HostStore

__all__ = ["DeviceTier", "Residency", "pick_device"]

logger = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]
SCORE_BYTES_PER_CHUNK = 64 << 20  # bounds the [queries x rows] score block one matrix product makes


def pick_device(device: str | None) -> str:
    """`device`, or "cuda" when torch sees a GPU and "cpu" otherwise; a CUDA request without one is an error."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {device!r} asked for, but torch sees no CUDA GPU; use device='cpu' or leave it unset")
    return device


@dataclass(frozen=True)
class Residency:
    """One published state of the device tier; never changed after it is built."""

    clusters: tuple[int, ...]  # resident clusters, in slab order
    resident: Array  # [nlist] bool
    starts: Array  # [nlist] int64: first slab row of each resident cluster (unused elsewhere)
    vectors: Any  # torch [rows, dim] float32 on the device
    ids: Any  # torch [rows] int64
    row_cluster: Any  # torch [rows] int64: the cluster of each row
    norms: Any  # torch [rows] float32: squared norms, for L2 (empty for inner product)
    nbytes: int

    @property
    def rows(self) -> int:
        return int(self.vectors.shape[0])


class DeviceTier:
    """Holds the current `Residency` and builds the next one; searched by `HybridSearch`."""

    def __init__(self, store: HostStore, sizes: Array, *, device: str, budget_bytes: int, row_bytes: int, metric: str) -> None:
        import torch

        self.store, self.sizes = store, sizes
        self.device = torch.device(device)
        self.budget_bytes, self.row_bytes, self.metric = int(budget_bytes), row_bytes, metric
        self.nlist = len(sizes)
        self._install_lock = threading.Lock()  # one builder at a time; searches never take it
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.current = self._build((), None)

    def cluster_bytes(self, cluster: int) -> int:
        return int(self.sizes[cluster]) * self.row_bytes

    def install(self, clusters: Sequence[int]) -> Residency:
        """Make exactly `clusters` resident (in that order of preference, cut at the budget) and publish it.

        Called on the retriever's background mover thread. Clusters already resident are copied
        within the device; the rest from the host store. Returns the published residency.
        """
        with self._install_lock:
            chosen, used = [], 0
            for c in dict.fromkeys(int(c) for c in clusters):
                size = self.cluster_bytes(c)
                if used + size <= self.budget_bytes and size > 0:
                    chosen.append(c)
                    used += size
            old = self.current
            if tuple(sorted(chosen)) == tuple(sorted(old.clusters)):
                return old
            self.current = self._build(tuple(chosen), old)
            return self.current

    def _build(self, clusters: tuple[int, ...], old: Residency | None) -> Residency:
        import torch

        lengths = [int(self.sizes[c]) for c in clusters]
        rows = sum(lengths)
        dim = self.store.vectors.shape[1]
        vectors = torch.empty((rows, dim), dtype=torch.float32, device=self.device)
        ids = torch.empty(rows, dtype=torch.int64, device=self.device)
        starts = np.full(self.nlist, -1, dtype=np.int64)
        row_cluster = np.repeat(np.array(clusters, dtype=np.int64), lengths)
        stream = self._stream
        if stream is not None:  # the new slabs come from the default stream's pool: let its pending work finish first
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            at = 0
            for c, n in zip(clusters, lengths):
                starts[c] = at
                if old is not None and old.resident[c]:  # already here: a copy within the device
                    src = slice(int(old.starts[c]), int(old.starts[c]) + n)
                    vectors[at : at + n].copy_(old.vectors[src])
                    ids[at : at + n].copy_(old.ids[src])
                else:  # from (pinned) host memory: asynchronous on CUDA
                    host = self.store.rows(c)
                    vectors[at : at + n].copy_(self.store.vectors[host], non_blocking=True)
                    ids[at : at + n].copy_(self.store.ids[host], non_blocking=True)
                at += n
            norms = (vectors * vectors).sum(dim=1) if self.metric == "l2" else vectors.new_empty(0)
            row_cluster_t = torch.from_numpy(row_cluster).to(self.device, non_blocking=True)
        if stream is not None:
            stream.synchronize()  # only this builder thread waits; searches keep using the old slab
        resident = np.zeros(self.nlist, dtype=bool)
        resident[list(clusters)] = True
        return Residency(clusters, resident, starts, vectors, ids, row_cluster_t, norms, rows * self.row_bytes)

    def search(self, residency: Residency, queries: Array, probes: Array, k: int) -> tuple[Array, Array]:
        """Top-k over the resident clusters among each query's probes (`probes`: [B, nprobe] cluster ids,
        -1 for slots to skip). Returns numpy (distances, ids) [B, k], FAISS's conventions: worst
        distance and id -1 where a query has fewer than k candidates."""
        import torch

        batch = len(queries)
        larger = self.metric == "ip"
        worst = -np.finfo(np.float32).max if larger else np.finfo(np.float32).max
        out_d = np.full((batch, k), worst, dtype=np.float32)
        out_i = np.full((batch, k), -1, dtype=np.int64)
        valid = probes >= 0
        if not valid.any() or residency.rows == 0:
            return out_d, out_i
        needed = np.unique(probes[valid])
        rows = self._rows_of(residency, needed)
        # wanted[b, c]: query b probes resident cluster c; a row counts for b when its cluster is wanted.
        wanted = np.zeros((batch, self.nlist), dtype=bool)
        b_idx, slot = np.nonzero(valid)
        wanted[b_idx, probes[b_idx, slot]] = True
        wanted_t = torch.from_numpy(wanted).to(self.device)
        q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32)).to(self.device)
        chunk = max(1, SCORE_BYTES_PER_CHUNK // (4 * batch))
        best_d, best_i = [], []
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            d, i = self._search_rows(residency, q, wanted_t, part, k, larger)
            best_d.append(d)
            best_i.append(i)
        d_all, i_all = torch.cat(best_d, dim=1), torch.cat(best_i, dim=1)
        take = min(k, d_all.shape[1])
        d_top, pos = torch.topk(d_all, take, dim=1, largest=larger, sorted=True)
        i_top = torch.gather(i_all, 1, pos)
        d_np, i_np = d_top.cpu().numpy(), i_top.cpu().numpy()
        found = i_np >= 0
        out_d[:, :take] = np.where(found, d_np, worst)
        out_i[:, :take] = np.where(found, i_np, -1)
        return out_d, out_i

    def _rows_of(self, residency: Residency, clusters: Array) -> Any:
        """The slab rows of `clusters` (resident ones only), as a device index tensor."""
        import torch

        present = clusters[residency.resident[clusters]]
        if len(present) == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        starts = residency.starts[present]
        lengths = self.sizes[present]
        if int(lengths.sum()) * 2 >= residency.rows:  # most of the slab: scan it whole, masked, without a gather
            return torch.arange(residency.rows, device=self.device)
        index = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        return torch.from_numpy(index).to(self.device)

    def _search_rows(self, residency: Residency, q: Any, wanted: Any, rows: Any, k: int, larger: bool) -> tuple[Any, Any]:
        import torch

        vectors = residency.vectors.index_select(0, rows)
        scores = q @ vectors.T
        if not larger:  # squared L2 from the product: |q|^2 - 2 q.v + |v|^2
            scores = (q * q).sum(dim=1, keepdim=True) - 2 * scores + residency.norms.index_select(0, rows)[None, :]
        mask = wanted[:, residency.row_cluster.index_select(0, rows)]
        scores = scores.masked_fill(~mask, float("-inf") if larger else float("inf"))
        take = min(k, scores.shape[1])
        d, pos = torch.topk(scores, take, dim=1, largest=larger, sorted=True)
        ids = residency.ids.index_select(0, rows)[pos]
        ids = torch.where(torch.isfinite(d), ids, torch.full_like(ids, -1))
        return d, ids

