"""Small deterministic components for the capture tests: each one's answers depend only on inputs."""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from pathlib import Path

import patchkit
from patchkit import Component, make

CORPUS = {
    "exceptions": "Use try and except to catch an exception.",
    "generators": "A generator function yields values lazily.",
    "decorators": "A decorator wraps a function to extend it.",
    "context": "The with statement manages a context.",
    "loops": "for and while loops repeat a block.",
}


def refuse(where: str, text: object) -> None:
    """Every corpus component fails on an input holding "boom", naming itself and the input: the corpus
    re-run on such inputs shows a deployment raises what plain Python raises, where it raises it."""
    if "boom" in str(text):
        raise ValueError(f"{where} cannot take {text!r}")


class Retriever(Component):
    """Keyword retriever over CORPUS; batched like a vector store."""

    def __init__(self, topk: int = 2) -> None:
        self.topk = topk
        self.loads = 0

    def setup(self) -> None:
        self.loads += 1
        self.index = {k: set(v.lower().replace(".", "").split()) | {k} for k, v in CORPUS.items()}

    @make(batch=True, read_only=True)
    def retrieve(self, query: list[str]) -> list[list[str]]:
        out = []
        for q in query:
            refuse("retrieve", q)
            words = set(q.lower().replace("?", "").split())
            scored = sorted(self.index, key=lambda k: (-len(words & self.index[k]), k))
            out.append([CORPUS[k] for k in scored[: self.topk] if words & self.index[k]])
        return out

    @make(read_only=True)
    def lookup(self, key: str) -> dict[str, str]:
        refuse("lookup", key)
        return {"title": key, "text": CORPUS.get(key, "")}


class Grader(Component):
    def __init__(self, threshold: int = 1) -> None:
        self.threshold = threshold

    @make(read_only=True)
    def grade(self, query: str, docs: list[str]) -> bool:
        refuse("grade", query)
        return len(docs) >= self.threshold

    @make(read_only=True)
    def score(self, text: str) -> int:
        refuse("score", text)
        return sum(map(ord, text)) % 7


class Generator(Component):
    def __init__(self, prefix: str = "A") -> None:
        self.prefix = prefix

    @make(read_only=True)
    def generate(self, prompt: str, docs: list[str] | None = None, max_words: int = 6) -> str:
        refuse(f"{self.prefix}.generate", prompt)
        words = (prompt + " " + " ".join(docs or [])).split()
        return f"{self.prefix}: " + " ".join(words[:max_words])

    @make(batch=True, read_only=True)
    def rewrite(self, query: list[str]) -> list[str]:
        for q in query:
            refuse("rewrite", q)
        return [q.replace("How do I", "how to").lower() + " python" for q in query]


class Flaky(Component):
    @make(read_only=True)
    def check(self, text: str) -> str:
        if "fail" in text:
            raise ValueError(f"cannot check {text!r}")
        return text.upper()


class Slow(Component):
    """Answers after a pause, like a model on an accelerator: gives a deployment work in flight."""

    def __init__(self, seconds: float = 0.01) -> None:
        self.seconds = seconds

    @make(read_only=True)
    def echo(self, text: str) -> str:
        time.sleep(self.seconds)
        return text.upper()

    @make(batch=True, read_only=True)
    def nap(self, text: list[str]) -> list[str]:
        time.sleep(self.seconds)  # once per batch
        return [t[::-1] for t in text]


class Hanger(Component):
    """Answers at once, except when asked to hang: then it never returns, as a wedged model call."""

    @make
    def echo(self, text: str) -> str:
        if text == "hang":
            time.sleep(10**6)
        return text.upper()


class Streamer(Component):
    """Streams an answer a word at a time, as a generator streams tokens.

    With `ack_dir`, it proves the stream reaches its reader while the answer is still being made:
    before its last word it waits (up to `wait_s`) for the reader to create the file `ack_dir/<prompt>`
    on reading the first word, and the last word says whether it did: "read", else "unread"."""

    def __init__(self, ack_dir: str | None = None, wait_s: float = 20.0) -> None:
        self.ack_dir = ack_dir
        self.wait_s = wait_s

    @make(stream=True, read_only=True)
    def generate(self, prompt: str) -> Iterator[str]:
        yield "Answer"
        for word in ("to", prompt, "is"):
            yield " " + word
        yield " " + self._last_word(prompt)

    def _last_word(self, prompt: str) -> str:
        if self.ack_dir is None:
            return "ready"
        ack, deadline = Path(self.ack_dir) / prompt, time.monotonic() + self.wait_s
        while not ack.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return "read" if ack.exists() else "unread"


class Crasher(Component):
    """Crashes its process with SIGSEGV on the texts `crash_on` names, as a C extension crashing on this CPU does (it
    reads address 0 through ctypes: the fault is its own thread's, so the call never returns; a signal sent with
    os.kill may reach another thread first and let the call answer); answers the others."""

    def __init__(self, crash_on: str = "") -> None:
        self.crash_on = crash_on

    @make
    def answer(self, text: str) -> str:
        if self.crash_on in text:
            ctypes.string_at(0)
        return text.upper()


class BrokenSetup(Component):
    """A component whose setup() fails, as when a model file is missing."""

    def setup(self) -> None:
        raise RuntimeError("model file is missing")

    @make
    def answer(self, text: str) -> str:
        return text


__all__ = ["CORPUS", "BrokenSetup", "Crasher", "Flaky", "Generator", "Grader", "Hanger", "Retriever", "Slow", "Streamer",
           "patchkit"]


class Vault(Component):
    """Looks up a secret: marked sensitive, so no step event shows what it returns."""

    sensitive = True

    @make(read_only=True)
    def lookup(self, text: str) -> str:
        return f"secret-{len(text)}"
