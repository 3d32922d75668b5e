"""Text as a generator streams it: token ids decoded into text deltas as they arrive, and deltas
stripped as a whole answer is, so that a stream's chunks join to exactly the answer a call returns."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Iterable, Iterator, Sequence

__all__ = ["StopText", "StrippedText", "TokenText", "decoded", "stripped", "until_stop"]

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


class StopText:
    """Deltas in, the text before the first of `stops` out, as OpenAI's `stop` cuts an answer: text that
    could begin a stop string is held back until what follows tells; once one appears, `stopped` is set
    and nothing more comes. `finish()` hands back what was held where the text ended without one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.stopped = False
        self._held = ""

    def feed(self, delta: str) -> str:
        if self.stopped or not self.stops:
            return "" if self.stopped else delta
        text = self._held + delta
        found = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if found:
            self.stopped, self._held = True, ""
            return text[: min(found)]
        keep = max((n for stop in self.stops for n in range(1, len(stop)) if text.endswith(stop[:n])), default=0)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def finish(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held


def until_stop(stop: StopText, deltas: Iterable[str]) -> Iterator[str]:
    """`deltas` cut at `stop`'s first stop string: iteration ends there, so its caller stops the engine."""
    for delta in deltas:
        if text := stop.feed(delta):
            yield text
        if stop.stopped:
            return
    if tail := stop.finish():
        yield tail


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
