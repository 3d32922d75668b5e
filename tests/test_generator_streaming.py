"""The pieces generators stream with: stripped deltas, incremental UTF-8-safe decoding, and the
background event loop whose iterators cancel their task when closed."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Iterator

import pytest

from patchkit.components.generators.background import BackgroundLoop
from patchkit.components.generators.streaming import StopText, TokenText, stripped, until_stop

TEXT = "  \n Grüße, 世界! A café — naïve 🙂 text.\n  \t"


def splits(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
def test_stripped_deltas_join_to_the_stripped_text(size: int) -> None:
    chunks = list(stripped(splits(TEXT, size)))
    assert "".join(chunks) == TEXT.strip()
    assert all(chunks) and chunks[0] == chunks[0].lstrip() and chunks[-1] == chunks[-1].rstrip()
    assert list(stripped(["  ", "\n", " "])) == []


@pytest.mark.parametrize("size", [1, 2, 3, 5, 100])
def test_a_stop_string_cuts_the_text_before_it_whatever_the_chunks(size: int) -> None:
    text = "one two three, four. five"
    stop = StopText([". ", "three,"])
    assert "".join(until_stop(stop, splits(text, size))) == "one two " and stop.stopped
    kept = StopText(["zz", "five!"])  # "five" could begin "five!": held back, then handed back at the end
    assert "".join(until_stop(kept, splits(text, size))) == text and not kept.stopped
    assert "".join(until_stop(StopText([]), splits(text, size))) == text


def test_until_stop_reads_nothing_after_the_stop() -> None:
    read: list[str] = []

    def chunks() -> Iterator[str]:
        for chunk in ["a ", "b ", "STOP", " c", " d"]:
            read.append(chunk)
            yield chunk

    assert list(until_stop(StopText(["STOP"]), chunks())) == ["a ", "b "]
    assert read == ["a ", "b ", "STOP"]  # the caller can stop its engine there


def test_token_text_never_yields_half_a_character() -> None:
    # Byte-level tokens, as a GPT-2 style tokenizer has: one byte each, so every multi-byte character is split.
    tokens = list(TEXT.encode())
    text = TokenText(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    deltas = [text.feed([token]) for token in tokens] + [text.finish()]
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in delta for delta in deltas)
    assert sum(1 for delta in deltas if delta) < len(tokens)  # held back inside characters


def test_token_text_waits_while_a_decoder_rewrites_what_it_gave() -> None:
    # A decoder that tidies " ," into "," rewrites text already handed back; the deltas wait for it.
    def decode(ids: list[int]) -> str:
        return "".join(map(chr, ids)).replace(" ,", ",")

    text = TokenText(decode)
    deltas = [text.feed([ord(c)]) for c in "a b ,c"] + [text.finish()]
    assert "".join(deltas) == "a b,c"


def test_the_loop_iterates_and_raises_in_the_consumers_thread() -> None:
    loop = BackgroundLoop("test-loop")

    async def numbers(fail: bool) -> AsyncIterator[int]:
        for i in range(3):
            await asyncio.sleep(0)
            yield i
        if fail:
            raise ValueError("failed on the loop")

    assert list(loop.iterate(numbers(False))) == [0, 1, 2]
    with pytest.raises(ValueError, match="failed on the loop"):
        list(loop.iterate(numbers(True)))
    assert loop.run(asyncio.sleep(0, "done")) == "done"
    loop.close()
    assert not loop.alive()


def test_closing_an_iterator_cancels_its_task_and_runs_its_cleanup() -> None:
    loop = BackgroundLoop("test-loop")
    cleaned = threading.Event()

    async def endless() -> AsyncIterator[int]:
        try:
            for i in itertools.count():
                await asyncio.sleep(0.001)
                yield i
        finally:
            cleaned.set()

    items = loop.iterate(endless())
    assert [next(items), next(items)] == [0, 1]
    items.close()
    assert cleaned.is_set()  # close() returns once the task's cleanup ran
    loop.close()
