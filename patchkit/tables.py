"""Plain-text tables for the terminal: plans, per-component statistics."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["text_table"]


def text_table(header: Sequence[str], rows: Sequence[Sequence[str]], *, left: int = 1) -> str:
    """Columns padded to their widest cell, a rule under the header; the first `left` columns align left."""
    table = [tuple(header), *(tuple(row) for row in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))

    return "\n".join([line(table[0]), "  ".join("-" * w for w in widths), *map(line, table[1:])])
