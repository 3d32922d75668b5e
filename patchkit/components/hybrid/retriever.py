"""`HybridIVFRetriever`: the component. FAISS IVF on the CPU plus a device tier of hot clusters,
lookahead prefetch, a device budget sized from a search SLO, and an exact merge.

Its answers equal `FaissRetriever(index="ivf")` at the same nlist and nprobe over the same index:
the device tier changes where a cluster is searched, never what is found.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from patchkit.component import make
from patchkit.components.embedder import Embedder
from patchkit.components.hybrid.budget import CpuLatencyModel, SloChoice, choose_share
from patchkit.components.hybrid.device import pick_device
from patchkit.components.hybrid.index import IvfIndex, build_ivf, load_ivf
from patchkit.components.hybrid.search import HybridSearch
from patchkit.components.retrievers import VectorRetriever, Vectors

__all__ = ["HybridIVFRetriever"]

logger = logging.getLogger(__name__)

CALIBRATION_QUERIES = 512  # corpus vectors standing in for queries when none are given


class HybridIVFRetriever(VectorRetriever):
    """Dense retrieval over a FAISS IVF index with the hottest clusters also on a GPU.

    - `nlist`, `nprobe`: the IVF index (nlist defaults to about sqrt(corpus size)).
    - `index_path`: load the IndexIVFFlat from this file when it exists (it must hold the corpus's
      vectors, in order), else build it from the corpus and write it there.
    - `device`: the torch device of the resident clusters; default "cuda" when torch sees a GPU,
      else "cpu". On "cpu" the tier runs the very torch code a GPU runs: this is how it is tested
      on machines without one.
    - `gpu_budget`: bytes (int), a share of the index (float in [0, 1]), or "slo": the smallest
      share whose predicted batch search time meets `search_slo_ms` for batches of `slo_batch`
      (profiled at setup, see `budget.py`), limited by `max_gpu_bytes` when given.
    - `cache_share`: the part of the budget for hot clusters; the rest holds prefetched ones.
    - `refresh_every`, `decay`: the hot set is recomputed in the background every that many
      batches, from access counts that decay by that factor per batch.
    - `generation_s`: the first guess of the time between `prefetch` and the search it serves
      (re-measured as prefetched clusters get used); with the measured link bandwidth it sizes a prefetch.
    - `calibration`: query texts that rank clusters for the SLO budget (default: corpus chunks).
    """

    devices = ("cpu", "gpu")

    def __init__(
        self,
        corpus: str | Sequence[str] = "pydoc",
        *,
        topk: int = 3,
        nlist: int | None = None,
        nprobe: int = 8,
        index_path: str | None = None,
        device: str | None = None,
        gpu_budget: int | float | str = 0.25,
        search_slo_ms: float | None = None,
        slo_batch: int = 32,
        max_gpu_bytes: int | None = None,
        cache_share: float = 0.75,
        refresh_every: int = 8,
        decay: float = 0.9,
        generation_s: float = 0.5,
        calibration: Sequence[str] | None = None,
        embedder: Embedder | None = None,
    ) -> None:
        _check_budget(gpu_budget, search_slo_ms)
        if nprobe < 1:
            raise ValueError(f"nprobe must be >= 1; got {nprobe}")
        if nlist is not None and nlist < 1:
            raise ValueError(f"nlist must be >= 1; got {nlist}")
        if slo_batch < 1:
            raise ValueError(f"slo_batch must be >= 1; got {slo_batch}")
        if not 0 <= cache_share <= 1:
            raise ValueError(f"cache_share must be in [0, 1]; got {cache_share}")
        super().__init__(corpus, topk=topk, embedder=embedder)
        self.nlist, self.nprobe, self.index_path = nlist, nprobe, index_path
        self.device, self.gpu_budget, self.search_slo_ms = device, gpu_budget, search_slo_ms
        self.slo_batch, self.max_gpu_bytes = slo_batch, max_gpu_bytes
        self.cache_share, self.refresh_every, self.decay, self.generation_s = cache_share, refresh_every, decay, generation_s
        self.calibration = list(calibration) if calibration is not None else None
        self.slo_choice: SloChoice | None = None

    def build(self, vectors: Vectors) -> None:
        """Load or build the IVF index, size the device budget, start the engine; called once by `setup()`."""
        raw = self._load_or_build(vectors)
        index = IvfIndex(raw, nprobe=min(self.nprobe, raw.nlist))
        device = pick_device(self.device)
        budget = self._budget(index, vectors)
        self.engine = HybridSearch(
            index, device=device, budget_bytes=budget, cache_share=self.cache_share,
            refresh_every=self.refresh_every, decay=self.decay, generation_s=self.generation_s,
        )
        logger.info("hybrid IVF: %d clusters, nprobe %d, %.1f MB of %.1f MB on %s",
                    index.nlist, index.nprobe, budget / 1e6, index.cluster_bytes().sum() / 1e6, device)

    def _load_or_build(self, vectors: Vectors) -> Any:
        import faiss

        path = Path(self.index_path).expanduser() if self.index_path else None
        if path is not None and path.is_file():
            raw = load_ivf(path)
            if raw.ntotal != len(vectors) or raw.d != vectors.shape[1]:
                raise ValueError(
                    f"{path} holds {raw.ntotal} vectors of dimension {raw.d}; the corpus has {len(vectors)} of "
                    f"dimension {vectors.shape[1]}: delete the file to rebuild it, or point index_path elsewhere"
                )
            return raw
        raw = build_ivf(vectors, nlist=self.nlist, metric="ip")
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            faiss.write_index(raw, str(path))
        return raw

    def _budget(self, index: IvfIndex, vectors: Vectors) -> int:
        total = int(index.cluster_bytes().sum())
        if isinstance(self.gpu_budget, str):  # "slo", checked in __init__
            budget = self._slo_budget(index, vectors)
        elif isinstance(self.gpu_budget, float):
            budget = int(self.gpu_budget * total)
        else:
            budget = int(self.gpu_budget)
        return min(budget, self.max_gpu_bytes) if self.max_gpu_bytes is not None else budget

    def _slo_budget(self, index: IvfIndex, vectors: Vectors) -> int:
        assert self.search_slo_ms is not None
        if self.calibration:
            queries = self.embedder.encode(self.calibration)
        else:
            rng = np.random.default_rng(0)
            queries = vectors[rng.choice(len(vectors), min(CALIBRATION_QUERIES, len(vectors)), replace=False)]
        centroid_d, probes = index.assign(queries)
        batch = min(self.slo_batch, len(queries))

        def search(assignment: np.ndarray[Any, Any]) -> object:
            return index.search_clusters(queries[:batch], self.topk, assignment, centroid_d[:batch])

        model = CpuLatencyModel.profile(search, probes[:batch], index.sizes)
        choice = choose_share(probes, index.sizes, index.row_bytes, model, slo_ms=self.search_slo_ms, batch=self.slo_batch)
        if not choice.meets_slo:
            logger.warning("no device share meets a %.1f ms search SLO (predicted %.1f ms with the whole index resident)",
                           self.search_slo_ms, choice.predicted_ms)
        self.slo_choice = choice
        return choice.budget_bytes

    def search(self, queries: Vectors, k: int) -> list[list[tuple[int, float]]]:
        distances, ids = self.engine.search(queries, min(k, self.engine.index.ntotal))
        return [[(int(i), float(s)) for i, s in zip(row_ids, row_d) if i >= 0] for row_ids, row_d in zip(ids, distances)]

    @make(batch=True, max_batch_size=64, read_only=True)
    def prefetch(self, query: list[str]) -> list[int]:
        """Start copying the clusters nearest each text to the device, ahead of a search expected soon.

        Called per text; the front-end calls it by itself with a generator's input when the
        generator's output becomes a query of this retriever. Returns the bytes asked for, at once.
        """
        sizes = [self.engine.prefetch(self.embedder.encode([q])) for q in query]
        return sizes

    def stats(self) -> dict[str, Any]:
        """Hit rates, bytes copied, prefetched and used, CPU and device search time, the chosen budget."""
        report = self.engine.report()
        if self.slo_choice is not None:
            report["slo"] = {
                "search_slo_ms": self.search_slo_ms, "share": self.slo_choice.share,
                "predicted_ms": self.slo_choice.predicted_ms, "tail_hit_rate": self.slo_choice.tail_hit_rate,
                "meets_slo": self.slo_choice.meets_slo,
            }
        return report

    def close(self) -> None:
        """Stop the engine's background threads; the retriever answers no more searches after it."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def _check_budget(gpu_budget: object, search_slo_ms: float | None) -> None:
    if isinstance(gpu_budget, str):
        if gpu_budget != "slo":
            raise ValueError(f"gpu_budget must be bytes (int), a share (float in [0, 1]) or 'slo'; got {gpu_budget!r}")
        if search_slo_ms is None or search_slo_ms <= 0:
            raise ValueError(f"gpu_budget='slo' needs search_slo_ms > 0; got search_slo_ms={search_slo_ms!r}")
    elif isinstance(gpu_budget, bool) or not isinstance(gpu_budget, (int, float)):
        raise ValueError(f"gpu_budget must be bytes (int), a share (float in [0, 1]) or 'slo'; got {gpu_budget!r}")
    elif isinstance(gpu_budget, float) and not 0 <= gpu_budget <= 1:
        raise ValueError(f"gpu_budget as a share must be in [0, 1]; got {gpu_budget}")
    elif gpu_budget < 0:
        raise ValueError(f"gpu_budget must be >= 0 bytes; got {gpu_budget}")
    elif search_slo_ms is not None:
        raise ValueError(f"search_slo_ms ({search_slo_ms}) applies only with gpu_budget='slo'; got gpu_budget={gpu_budget!r}")
