"""The exact merge of two top-k lists over disjoint sets of clusters (device and CPU)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["merge_topk"]

Array = np.ndarray[Any, Any]


def merge_topk(parts: list[tuple[Array, Array]], k: int, *, larger_is_better: bool, worst: float) -> tuple[Array, Array]:
    """The best `k` of each row over every part's (distances, ids), best first, FAISS's conventions.

    Each part holds the top-k of its own disjoint clusters, so the best k of their union are the
    best k over all those clusters: the merge is exact. Slots with id -1 never win; rows with
    fewer than k results end in (worst, -1) as FAISS fills them. Ties keep the first part's entry first.
    """
    distances = np.concatenate([d for d, _ in parts], axis=1)
    ids = np.concatenate([i for _, i in parts], axis=1)
    key = np.where(ids >= 0, -distances if larger_is_better else distances, np.inf)
    order = np.argsort(key, axis=1, kind="stable")[:, :k]
    top_d = np.take_along_axis(distances, order, axis=1)
    top_i = np.take_along_axis(ids, order, axis=1)
    empty = top_i < 0
    top_d[empty], top_i[empty] = worst, -1
    if top_d.shape[1] < k:  # fewer candidates than k in all parts together
        pad = k - top_d.shape[1]
        top_d = np.pad(top_d, ((0, 0), (0, pad)), constant_values=worst)
        top_i = np.pad(top_i, ((0, 0), (0, pad)), constant_values=-1)
    return top_d.astype(np.float32, copy=False), top_i.astype(np.int64, copy=False)
