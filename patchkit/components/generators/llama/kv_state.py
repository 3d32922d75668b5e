"""llama.cpp's sequence state (`llama_state_seq_get_data`) cut into runs of positions and joined again.

llama.cpp saves and restores a sequence's KV cells whole. A document KV cache keeps each document's
cells apart (a prefix is the documents' runs joined), so this module reads the state's layout: an
optional header (a magic number and the source sequence), the number of KV streams, then per stream a
cell count, and for the stream holding the sequence its cells' metadata (position, sequence ids) and
data: per layer the keys a row per cell, then per layer the values, a row per cell or, transposed, a
run of cells per embedding element. `Cells` holds the cells of positions [start, end) in that layout,
`StateLayout.cut` copies a run of them out of a state, and `StateLayout.join_into` writes runs as one
state to restore, copying each run's bytes once, straight into the caller's buffer.

The layout is llama.cpp's, not a stable interface: `StateLayout.read` checks every length against
the bytes it reads and raises `StateLayoutError` on anything else (another version's layout, cells
spread over several streams, cells out of position order), and its caller keeps nothing then. A state
read may start at any position (a document evaluated alone, away from the prompt's positions); its
cells then follow each other from there.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["Cells", "StateLayout", "StateLayoutError"]

MAGIC = 0xAF143CD8  # llama.cpp's sequence state header, where a version writes one
CELL_EXTRA = (0, 12)  # bytes a cell's metadata may carry beyond position and ids (M-RoPE's 2D position, its token)


class StateLayoutError(ValueError):
    """The bytes are not a sequence state in the layout this module reads."""


@dataclass(frozen=True)
class Cells:
    """The KV cells of positions [start, end) of one sequence: per-cell metadata rows, per-layer key
    rows, and per-layer values (rows per cell, or with `v_trans`, a row per embedding element)."""

    start: int
    end: int
    meta: np.ndarray
    keys: tuple[np.ndarray, ...]
    values: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return int(self.meta.nbytes + sum(a.nbytes for a in self.keys) + sum(a.nbytes for a in self.values))


@dataclass(frozen=True)
class StateLayout:
    """What every state of one context shares: its header, stream count, and the per-layer record
    headers (type and row size) in front of the keys and values."""

    header: bytes
    n_stream: int
    v_trans: bool
    key_heads: tuple[bytes, ...]
    value_heads: tuple[bytes, ...]

    @staticmethod
    def read(blob: bytes | memoryview | np.ndarray, n_layer: int) -> tuple[StateLayout, Cells]:
        """The layout of `blob` (a whole sequence state of a model with `n_layer` layers, its cells at
        consecutive positions in order) and its cells, as views of `blob`: `cut` copies runs of them."""
        data = memoryview(blob).cast("B")  # type: ignore[arg-type]  # an ndarray is a buffer
        errors = []
        for extra in CELL_EXTRA:
            try:
                return _Reader(data, n_layer, 12 + extra).read()
            except (StateLayoutError, struct.error) as exc:
                errors.append(str(exc))
        raise StateLayoutError(f"not a llama.cpp sequence state in a layout patchkit reads: {'; '.join(errors)}")

    def cut(self, cells: Cells, start: int, end: int) -> Cells:
        """A copy of the cells of positions [start, end) among `cells`."""
        if not cells.start <= start <= end <= cells.end:
            raise ValueError(f"positions [{start}, {end}) are not within [{cells.start}, {cells.end})")
        rows = slice(start - cells.start, end - cells.start)
        if self.v_trans:  # a row per embedding element, holding each cell's element in turn
            values = [v.reshape(v.shape[0], cells.end - cells.start, -1)[:, rows].reshape(v.shape[0], -1) for v in cells.values]
        else:
            values = [v[rows] for v in cells.values]
        return Cells(start, end, cells.meta[rows].copy(), tuple(k[rows].copy() for k in cells.keys),
                     tuple(v.copy() for v in values))

    def join(self, runs: Sequence[Cells]) -> bytes:
        """One state holding `runs`, consecutive runs of positions from 0, for `llama_state_seq_set_data`."""
        if not runs or runs[0].start != 0 or any(a.end != b.start for a, b in zip(runs, runs[1:])):
            raise ValueError("runs must follow each other from position 0")
        out = np.empty(self.size(runs), np.uint8)
        return self.join_into(runs, out).tobytes()

    def size(self, runs: Sequence[Cells]) -> int:
        """The bytes of the state `join_into` writes for `runs`."""
        heads = len(self.header) + 16 + sum(map(len, self.key_heads)) + sum(map(len, self.value_heads))
        return heads + sum(r.nbytes for r in runs) + 4 * (self.n_stream - 1)

    def join_into(self, runs: Sequence[Cells], out: np.ndarray) -> np.ndarray:
        """Write one state holding `runs` (cells in the order given, at the positions their metadata
        names) into the head of `out` (uint8, at least `size(runs)` bytes), each run's bytes copied once;
        the state, a view of `out`. Called by the document cache when it restores a prefix."""
        if not runs:
            raise ValueError("a state needs at least one run of cells")
        cells, at = sum(r.end - r.start for r in runs), 0

        def put(part: bytes | np.ndarray) -> None:
            nonlocal at
            raw = np.frombuffer(part, np.uint8) if isinstance(part, bytes) else part.reshape(-1).view(np.uint8)
            out[at:at + raw.size] = raw
            at += raw.size

        put(self.header)
        put(struct.pack("<II", self.n_stream, cells))
        for run in runs:
            put(run.meta)
        put(struct.pack("<II", int(self.v_trans), len(self.key_heads)))
        for layer, head in enumerate(self.key_heads):
            put(head)
            for run in runs:
                put(run.keys[layer])
        for layer, head in enumerate(self.value_heads):
            put(head)
            if not self.v_trans:
                for run in runs:
                    put(run.values[layer])
                continue
            # A row per embedding element, holding each cell's element in turn: runs side by side in each row.
            rows = runs[0].values[layer].shape[0]
            block = out[at:at + sum(r.values[layer].size for r in runs)].reshape(rows, -1)
            column = 0
            for run in runs:
                width = run.values[layer].shape[1]
                block[:, column:column + width] = run.values[layer]
                column += width
            at += block.size
        put(bytes(4 * (self.n_stream - 1)))  # the other streams: no cells
        return out[:at]


class _Reader:
    """One pass over a state's bytes, checking each length as it goes."""

    def __init__(self, data: memoryview, n_layer: int, cell_meta: int) -> None:
        self.data, self.n_layer, self.cell_meta, self.at = data, n_layer, cell_meta, 0

    def take(self, fmt: str) -> tuple[int, ...]:
        values = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def array(self, rows: int, width: int) -> np.ndarray:
        if self.at + rows * width > len(self.data):
            raise StateLayoutError("the state ends inside a record")
        found = np.frombuffer(self.data, np.uint8, rows * width, self.at).reshape(rows, width)
        self.at += rows * width
        return found

    def read(self) -> tuple[StateLayout, Cells]:
        header = bytes(self.data[:8]) if self.take("<I")[0] == MAGIC else b""
        self.at = len(header)
        (n_stream,) = self.take("<I")
        counts: list[int] = []
        while len(counts) < n_stream and not any(counts):
            counts += self.take("<I")
        if not any(counts):
            raise StateLayoutError("the state holds no cells")
        cells, rest = counts[-1], 4 * (n_stream - len(counts))  # the streams after the sequence's: no cells
        meta = self.array(cells, self.cell_meta)
        positions = meta[:, :4].copy().view("<i4").ravel()
        if not np.array_equal(positions, np.arange(cells) + positions[0]):
            raise StateLayoutError("the cells are not at consecutive positions in order")
        v_trans, n_layer = self.take("<II")
        if v_trans not in (0, 1) or n_layer != self.n_layer:
            raise StateLayoutError(f"a data header of v_trans {v_trans} and {n_layer} layers (the model has {self.n_layer})")
        key_heads, keys = [], []
        for _ in range(n_layer):
            key_heads.append(bytes(self.data[self.at:self.at + 12]))
            keys.append(self.array(cells, self.take("<iQ")[1]))
        value_heads, values = [], []
        while self.at < len(self.data) - rest:
            value_heads.append(bytes(self.data[self.at:self.at + 12]))
            if v_trans:
                _, element, width = self.take("<iII")
                values.append(self.array(width, cells * element))
            else:
                values.append(self.array(cells, self.take("<iQ")[1]))
        if self.at != len(self.data) - rest or any(self.data[self.at:]):
            raise StateLayoutError("the state does not end where its records do")
        layout = StateLayout(header, n_stream, bool(v_trans), tuple(key_heads), tuple(value_heads))
        first = int(positions[0])
        return layout, Cells(first, first + cells, meta, tuple(keys), tuple(values))
