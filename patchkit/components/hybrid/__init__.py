"""The hybrid CPU/GPU IVF retriever: FAISS IVF on the CPU plus a device tier of hot clusters.

Modules, one concern each: `index` (the FAISS IVF base and its host store), `device` (resident
clusters as torch tensors and their search), `cache` (which clusters should be resident: hot
counts and lookahead), `merge` (the exact top-k merge), `budget` (the device share for a search
SLO), `search` (the engine that ties them together), `retriever` (the component).
"""

from patchkit.components.hybrid.retriever import HybridIVFRetriever
from patchkit.components.hybrid.search import HybridSearch

__all__ = ["HybridIVFRetriever", "HybridSearch"]
