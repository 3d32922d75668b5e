"""Text as a generator streams it: token ids decoded into text deltas as they arrive, and deltas
stripped as a whole answer is, so that a stream's chunks join to exactly the answer a call returns."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Iterator

__all__ = ["StrippedText", "TokenText", "decoded", "stripped"]

REPLACEMENT = "\ufffd"  # what a decoder makes of the first bytes of a character split across tokens


class StrippedText:
    """Deltas in, the deltas of their stripped concatenation out: whitespace before the first visible
    character is dropped, whitespace after the last visible one so far is held back until more text
    follows it, and dropped if none does. `"".join(feed(d) for d in deltas) == "".join(deltas).strip()`."""

    def __init__(self) -> None:
        self._started = False
        self._held = ""

    def feed(self, delta: str) -> str:
        if not self._started:
            delta = delta.lstrip()
            if not delta:
                return ""
            self._started = True
        text = self._held + delta
        body = text.rstrip()
        self._held = text[len(body) :]
        return body


def stripped(deltas: Iterable[str]) -> Iterator[str]:
    """`deltas` as `StrippedText` passes them, without the empty ones."""
    text = StrippedText()
    for delta in deltas:
        if chunk := text.feed(delta):
            yield chunk


def decoded(pieces: Iterable[bytes]) -> Iterator[str]:
    """Text from token byte pieces (llama.cpp's) as they come. A character whose bytes span several
    tokens is yielded once all of them arrived, never as replacement characters; bytes that never
    complete one become U+FFFD at the end, as a whole-answer decode with errors='replace' would make them."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for piece in pieces:
        if text := decoder.decode(piece):
            yield text
    if tail := decoder.decode(b"", final=True):
        yield tail


class TokenText:
    """Token ids in, text deltas out, for one answer decoded incrementally.

    Each `feed` decodes every id so far with `decode` (the same call that decodes a whole answer) and
    hands back what was added since the last delta, up to its last visible character. It holds the
    text back while it ends in an incomplete UTF-8 character (a byte-level token carries part of one),
    and trailing whitespace until what follows it is known (a decoder that tidies spaces, as
    `clean_up_tokenization_spaces`, drops the space before punctuation), so that the deltas join to
    `decode(all ids)`; `finish` adds the rest. Should a decoder rewrite visible text already handed
    back, the deltas wait until it starts with it again, and the rest is lost.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._text = ""

    def feed(self, ids: Iterable[int]) -> str:
        self._ids.extend(ids)
        # Up to the last visible character: a decoder that tidies spaces rewrites a space before what follows it.
        text = self._decode(self._ids).rstrip()
        if text.endswith(REPLACEMENT) or not text.startswith(self._text):
            return ""
        return self._advance(text)

    def finish(self) -> str:
        """The text not handed back yet, once the answer has all its ids."""
        text = self._decode(self._ids)
        return self._advance(text) if text.startswith(self._text) else ""

    def _advance(self, text: str) -> str:
        delta, self._text = text[len(self._text) :], text
        return delta
