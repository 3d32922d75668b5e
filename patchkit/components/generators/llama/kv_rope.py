"""`KeyRotation`: a document's cached KV cells moved to other positions on the host, their keys
rotated there (RoPE), so that llama.cpp has nothing to shift.

llama.cpp moves cells with `llama_memory_seq_add`, and rotates their keys at its next decode (the
K-shift). That shift runs over every cell of every stream of the context, whichever cells moved: on
an engine of 25 slots of 2048 cells, about a second of a 135M model's time on one core, per document
placed, while every running sequence waits. The rotation a moved cell needs is the cell's alone: its
keys, rotated by the distance, as `ggml_rope_ext` rotates them (each pair of a head's first `n_rot`
dimensions by `distance * freq_scale * base ** (-2i / n_rot)`; adjacent pairs, or NEOX's halves). So
`KeyRotation.moved` rotates a copy of the document's key rows in numpy, rewrites the cells'
positions, and the engine writes them where they belong: the work grows with the document, not with
the context.

`KeyRotation.of` reads the rotation from the model; it is None (and the engine keeps llama.cpp's
shift, saying so in its log) for a model whose keys it cannot rotate exactly so: keys not stored as
F16 or F32, M-RoPE, YaRN or other scaling that changes the angles by position.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from patchkit.components.generators.llama.kv_state import Cells, StateLayout

__all__ = ["KeyRotation"]

logger = logging.getLogger(__name__)

KEY_TYPES = {0: np.float32, 1: np.float16}  # ggml type ids of the keys rotated here: F32, F16
ROPE_NORM, ROPE_NEOX = 0, 2  # llama.cpp's rope types rotated here: adjacent pairs, or a head's two halves


@dataclass(frozen=True)
class KeyRotation:
    """How one model's keys turn with their position: per KV head of `head_dim` dimensions, the first
    `n_rot` rotated in pairs (`neox`: a head's halves, else adjacent) at `base` and `scale`."""

    n_head_kv: int
    head_dim: int
    n_rot: int
    base: float
    scale: float
    neox: bool

    @classmethod
    def of(cls, lib: Any, model: Any) -> KeyRotation | None:
        """The rotation of `model` (a llama-cpp-python `LlamaModel`), None where it is not one this
        module rotates exactly (the reason logged)."""
        meta = model.metadata()
        arch = meta.get("general.architecture", "")
        rope = lib.llama_model_rope_type(model.model)
        scaling = meta.get(f"{arch}.rope.scaling.type", "none")
        n_head, n_head_kv = lib.llama_model_n_head(model.model), lib.llama_model_n_head_kv(model.model)
        head_dim = int(meta.get(f"{arch}.attention.key_length", lib.llama_model_n_embd(model.model) // max(1, n_head)))
        n_rot = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
        why = (f"rope type {rope}" if rope not in (ROPE_NORM, ROPE_NEOX) else
               f"rope scaling {scaling!r}" if scaling not in ("none", "linear") else
               f"{n_rot} rotated dimensions of a {head_dim}-dimension head" if not 0 < n_rot <= head_dim or n_rot % 2 else "")
        if why:
            logger.info("documents placed under kv_reuse='blend' are moved by llama.cpp's K-shift: %s", why)
            return None
        base = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
        return cls(n_head_kv, head_dim, n_rot, base, float(lib.llama_model_rope_freq_scale_train(model.model)),
                   rope == ROPE_NEOX)

    def fits(self, layout: StateLayout) -> bool:
        """Whether every layer's keys in `layout` are of a type and row size this rotation handles."""
        for head in layout.key_heads:
            key_type, row = struct.unpack("<iQ", head)
            width = self.n_head_kv * self.head_dim
            if key_type not in KEY_TYPES or row != width * np.dtype(KEY_TYPES[key_type]).itemsize:
                return False
        return True

    def angles(self, distance: int) -> tuple[np.ndarray, np.ndarray]:
        """The cosines and sines of the rotation by `distance` positions, one per rotated pair, in float32
        as ggml computes them (each pair's frequency the one before times base ** (-2 / n_rot))."""
        exponent = np.float32(-2.0) / np.float32(self.n_rot)
        step = np.float32(np.float64(np.float32(self.base)) ** np.float64(exponent))  # powf, correctly rounded
        theta = np.empty(self.n_rot // 2, np.float32)
        value = np.float32(distance) * np.float32(self.scale)
        for i in range(theta.size):
            theta[i] = value
            value = np.float32(value * step)
        # In double, then rounded: the correctly rounded float cosf and sinf of C's library, as ggml calls.
        wide = theta.astype(np.float64)
        return np.cos(wide).astype(np.float32), np.sin(wide).astype(np.float32)

    def moved(self, layout: StateLayout, cells: Cells, to: int) -> Cells:
        """A copy of `cells` at positions from `to` on, their keys rotated by the distance; called by the
        blender on the engine thread when it places a document."""
        distance = to - cells.start
        meta = cells.meta.copy()
        meta[:, :4] = (np.arange(cells.end - cells.start, dtype="<i4") + to).view(np.uint8).reshape(-1, 4)
        if distance == 0:
            return replace(cells, meta=meta)
        cos, sin = self.angles(distance)
        keys = []
        for head, rows in zip(layout.key_heads, cells.keys):
            dtype = KEY_TYPES[struct.unpack("<iQ", head)[0]]
            k = rows.view(dtype).astype(np.float32).reshape(len(rows), self.n_head_kv, self.head_dim)
            first, second = (slice(0, self.n_rot // 2), slice(self.n_rot // 2, self.n_rot)) if self.neox else (
                slice(0, self.n_rot, 2), slice(1, self.n_rot, 2))
            x0, x1 = k[..., first].astype(np.float64), k[..., second].astype(np.float64)
            # As a compiler contracts ggml's `x0*cos - x1*sin` into a fused multiply-add: the second product
            # rounded to float, the first exact in double, their sum rounded once.
            k[..., first] = x0 * cos - (x1 * sin).astype(np.float32)
            k[..., second] = x0 * sin + (x1 * cos).astype(np.float32)
            keys.append(k.astype(dtype).reshape(len(rows), -1).view(np.uint8))
        return Cells(to, to + cells.end - cells.start, meta, tuple(keys), cells.values)
