"""Token bytes to text chunks: incremental UTF-8 decoding and answer stripping, shared by streaming generators."""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Iterator

__all__ = ["decoded", "stripped"]


def decoded(pieces: Iterable[bytes]) -> Iterator[str]:
    """Text from token byte pieces as they come. A character whose bytes span several tokens is yielded
    once all of them arrived, never as replacement characters; bytes that never complete one become
    U+FFFD at the end, as a whole-answer decode with errors='replace' would make them."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for piece in pieces:
        text = decoder.decode(piece)
        if text:
            yield text
    tail = decoder.decode(b"", final=True)
    if tail:
        yield tail


def stripped(chunks: Iterable[str]) -> Iterator[str]:
    """`chunks` without the answer's leading and trailing whitespace: their concatenation equals
    `"".join(chunks).strip()`. Whitespace inside the answer is held back until text follows it."""
    started, held = False, ""
    for chunk in chunks:
        if not started:
            chunk = chunk.lstrip()
            started = bool(chunk)
        body = chunk.rstrip()
        if body:
            yield held + body
            held = chunk[len(body):]
        else:
            held += chunk
