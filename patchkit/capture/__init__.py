"""Capture: frame -> bytecode -> IR -> graph. Internal; the public face is `patchkit.capture()`."""

from patchkit.capture import (
    analysis,
    assemble,
    compat,
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
)

__all__ = [
    "analysis",
    "assemble",
    "compat",
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
]
