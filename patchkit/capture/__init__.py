"""Capture: frame -> bytecode -> IR -> graph. Internal; the public face is `patchkit.capture()`."""

from patchkit.capture import (
    analysis,
    assemble,
    compat,
    control,
    dataflow,
    extract,
    frame,
    graph,
    holders,
    ir,
    recorder,
    render,
    rewrite,
    skip,
    stack,
    values,
)

__all__ = [
    "analysis",
    "assemble",
    "compat",
    "control",
    "dataflow",
    "extract",
    "frame",
    "graph",
    "holders",
    "ir",
    "recorder",
    "render",
    "rewrite",
    "skip",
    "stack",
    "values",
]
