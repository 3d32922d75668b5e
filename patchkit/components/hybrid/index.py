"""The CPU tier: a FAISS IVF-Flat index, its inverted lists laid out per cluster, and the two
searches the hybrid retriever needs from it (coarse assignment, and a search of given clusters).

Every cluster's vectors are also copied once into a host store, contiguous per cluster (pinned
memory when the device tier is on CUDA), so the device tier can copy a cluster in one transfer.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["IvfIndex", "build_ivf", "load_ivf"]

logger = logging.getLogger(__name__)

Array = np.ndarray[Any, Any]
METRICS = ("ip", "l2")


def build_ivf(vectors: Array, *, nlist: int | None = None, metric: str = "ip", seed: int = 1234) -> Any:
    """Train and fill a FAISS IndexIVFFlat over `vectors` (float32, one row per document).

    `nlist` defaults to about sqrt(n), held to n/39 so k-means gets the training points FAISS asks for.
    """
    import faiss

    if metric not in METRICS:
        raise ValueError(f"metric must be one of {METRICS}; got {metric!r}")
    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if vectors.ndim != 2 or len(vectors) == 0:
        raise ValueError(f"vectors must be a non-empty 2-D array; got shape {vectors.shape}")
    n, dim = vectors.shape
    nlist = nlist or max(1, min(int(math.sqrt(n)), n // 39))
    if not 1 <= nlist <= n:
        raise ValueError(f"nlist ({nlist}) must be between 1 and the number of vectors ({n})")
    faiss_metric = faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2
    quantizer: Any = faiss.IndexFlat(dim, faiss_metric)
    index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss_metric)
    index.own_fields = True  # the index frees its quantizer: no Python reference needs to keep it alive
    quantizer.this.disown()
    index.cp.seed = seed
    index.train(vectors)
    index.add(vectors)
    return index


def load_ivf(path: str | Path) -> Any:
    """Read an IndexIVFFlat written by `faiss.write_index`; anything else is an error naming the file."""
    import faiss

    index = faiss.read_index(str(path))
    if not isinstance(index, faiss.IndexIVFFlat):
        raise ValueError(f"{path} holds a {type(index).__name__}; the hybrid retriever needs a FAISS IndexIVFFlat")
    return index


@dataclass
class HostStore:
    """Every cluster's vectors and ids, contiguous per cluster: rows offsets[c]:offsets[c+1] are cluster c."""

    vectors: Any  # torch.Tensor [ntotal, dim] float32 on the CPU (pinned for a CUDA device tier)
    ids: Any  # torch.Tensor [ntotal] int64
    offsets: Array  # [nlist + 1] int64

    def rows(self, cluster: int) -> slice:
        return slice(int(self.offsets[cluster]), int(self.offsets[cluster + 1]))


class IvfIndex:
    """A FAISS IVF-Flat index searched in two parts: the clusters the device holds, and the rest here."""

    def __init__(self, index: Any, *, nprobe: int) -> None:
        import faiss

        if not isinstance(index, faiss.IndexIVFFlat):
            raise TypeError(f"IvfIndex needs a faiss.IndexIVFFlat; got {type(index).__name__}")
        if index.ntotal == 0:
            raise ValueError("the IVF index is empty: add vectors before searching it")
        self.index: Any = index  # FAISS's SWIG stubs do not know the numpy wrappers used below
        self.dim: int = index.d
        self.nlist: int = index.nlist
        self.metric = "ip" if index.metric_type == faiss.METRIC_INNER_PRODUCT else "l2"
        if index.metric_type not in (faiss.METRIC_INNER_PRODUCT, faiss.METRIC_L2):
            raise ValueError("the IVF index must use the inner-product or L2 metric")
        invlists: Any = index.invlists
        self.sizes = np.array([invlists.list_size(c) for c in range(self.nlist)], dtype=np.int64)
        # Bytes a resident cluster takes on the device: its vectors, ids and (for L2) norms.
        self.row_bytes = 4 * self.dim + 8 + (4 if self.metric == "l2" else 0)
        # FAISS fills a result slot it has nothing for with id -1 and the worst distance.
        self.worst = np.float32(-np.finfo(np.float32).max if self.metric == "ip" else np.finfo(np.float32).max)
        if not 1 <= nprobe <= self.nlist:
            raise ValueError(f"nprobe ({nprobe}) must be between 1 and the index's nlist ({self.nlist})")
        self.nprobe = nprobe
        # search_preassigned takes no per-call parameters and checks the assignment's width against the
        # index's own nprobe: it is set once here and never changed while searches run.
        index.nprobe = nprobe
        index.parallel_mode = 1  # split one query's probes over the threads: both cores work on a batch of one

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    @property
    def larger_is_better(self) -> bool:
        return self.metric == "ip"

    def cluster_bytes(self) -> Array:
        return self.sizes * self.row_bytes

    def host_store(self, *, pin: bool = False) -> HostStore:
        """Copy every inverted list into one array, cluster after cluster; called once by the retriever's setup."""
        import faiss
        import torch

        offsets = np.zeros(self.nlist + 1, dtype=np.int64)
        np.cumsum(self.sizes, out=offsets[1:])
        vectors = torch.empty((self.ntotal, self.dim), dtype=torch.float32, pin_memory=pin)
        ids = torch.empty(self.ntotal, dtype=torch.int64, pin_memory=pin)
        flat_vectors, flat_ids = vectors.numpy(), ids.numpy()
        invlists = self.index.invlists
        for c in range(self.nlist):
            n = int(self.sizes[c])
            if n == 0:
                continue
            codes = faiss.rev_swig_ptr(invlists.get_codes(c), n * self.dim * 4)
            start = int(offsets[c])
            flat_vectors[start : start + n] = np.frombuffer(codes, dtype=np.float32).reshape(n, self.dim)
            flat_ids[start : start + n] = faiss.rev_swig_ptr(invlists.get_ids(c), n)
        return HostStore(vectors, ids, offsets)

    def assign(self, queries: Array, nprobe: int | None = None) -> tuple[Array, Array]:
        """The `nprobe` (default: the index's) clusters nearest each query, nearest first, with their centroid distances."""
        distances, clusters = self.index.quantizer.search(queries, nprobe or self.nprobe)
        return distances, clusters

    def search_clusters(self, queries: Array, k: int, clusters: Array, centroid_distances: Array) -> tuple[Array, Array]:
        """Top-k of each query over the clusters in its row of `clusters`; -1 slots are skipped.

        Called by the hybrid search on its CPU thread for the clusters the device does not hold.
        FAISS releases the GIL here, so the device search runs at the same time.
        """
        distances, labels = self.index.search_preassigned(queries, k, clusters, centroid_distances)
        return distances, labels
