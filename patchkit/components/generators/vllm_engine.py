"""`VLLMGenerator`.

A chat model on NVIDIA GPUs through vLLM's async engine, whose continuous batching admits each call as it arrives and streams its
tokens back.
"""

from __future__ import annotations

import inspect
import os
import shutil
import uuid
import weakref
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from patchkit.components.generators.background import BackgroundLoop
from patchkit.components.generators.base import DEFAULT_SYSTEM_PROMPT, Generator
from patchkit.components.generators.streaming import stripped
from patchkit.core import make
from patchkit.core.options import CallOptions, CallReport

__all__ = ["VLLMGenerator"]

MAX_CONCURRENCY = 256  # requests one replica keeps in its engine at once
HEALTH_TIMEOUT_S = 30.0


class VLLMGenerator(Generator):
    """A chat model served in-process by vLLM's `AsyncLLMEngine`, on one or more NVIDIA GPUs.

    `generate(prompt, docs=None, max_tokens=None)` answers one prompt in pipeline code, as every
    Generator, and streams it to a streaming request. The engine runs on an event loop in a thread of
    the replica (`setup()` starts both); each call submits its request there, joins the engine's
    running batch at its next step, and reads the new text as it comes. A replica takes up to 256
    calls at once. A caller that closes its stream aborts its request in the engine. Greedy at
    temperature 0; above it, each prompt samples with its own generator seeded with `seed`.

    Args:
        model: a local model directory, or the Hugging Face id of a model already in the local Hugging
            Face cache; nothing is downloaded (fetch it first, as `huggingface-cli download ID`).
        max_tokens: the most tokens an answer takes unless its call says otherwise.
        temperature: 0 answers greedily; above it, answers are sampled.
        seed: the sampling generator's seed.
        system_prompt: the chat's system prompt (None: none).
        gpu_memory_utilization: the share of each GPU's memory vLLM takes for weights and KV cache.
        max_model_len: the context, in tokens (default: the model's own).
        dtype: "auto" (the checkpoint's, float16 where that is float32), "float16", "bfloat16" or "float32".
        tensor_parallel_size: GPUs to shard the model over.
    """

    devices = ("gpu",)
    honoured_options = frozenset({"max_tokens", "stop", "temperature", "top_p", "seed", "presence_penalty",
                                  "frequency_penalty", "logprobs", "top_logprobs", "ignore_eos", "min_tokens"})

    def __init__(
        self,
        model: str,
        *,
        max_tokens: int = 96,
        temperature: float = 0.0,
        seed: int = 0,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        gpu_memory_utilization: float = 0.85,
        max_model_len: int | None = None,
        dtype: str = "auto",
        tensor_parallel_size: int = 1,
    ) -> None:
        if _looks_like_path(model) and not Path(model).expanduser().exists():
            raise FileNotFoundError(
                f"model {model} does not exist; pass a local model directory or the id of a model in the "
                "Hugging Face cache (VLLMGenerator downloads nothing)"
            )
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization ({gpu_memory_utilization}) must be in (0, 1]")
        if max_model_len is not None and max_model_len < 16:
            raise ValueError(f"max_model_len ({max_model_len}) must be >= 16")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size ({tensor_parallel_size}) must be >= 1")
        super().__init__(max_tokens=max_tokens, temperature=temperature, seed=seed, system_prompt=system_prompt)
        self.model = str(Path(model).expanduser()) if _looks_like_path(model) else model
        self.gpu_memory_utilization, self.max_model_len = gpu_memory_utilization, max_model_len
        self.dtype, self.tensor_parallel_size = dtype, tensor_parallel_size

    def version_files(self) -> list[str]:
        """A local model directory: a model replaced there is a new version (a hub id: declare `version`)."""
        return [self.model] if _looks_like_path(self.model) else []

    def setup(self) -> None:
        """Start the engine, on an event loop in a daemon thread, on the GPUs this process sees, from local files only."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files are all we read: never the network
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        if not _cuda_visible():
            raise RuntimeError(
                "VLLMGenerator needs an NVIDIA GPU, and this process sees none (no driver, a CPU build of torch, or "
                "CUDA_VISIBLE_DEVICES hides them); use TransformersGenerator or LlamaCppGenerator on CPU"
            )
        try:
            import vllm  # noqa: F401 - checked here, where its absence can be said plainly
        except ImportError as exc:
            raise ImportError(f"VLLMGenerator needs vllm, which is not installed: pip install -e '.[gpu]' in patchkit's "
                              f"checkout ({exc})") from exc
        if not _looks_like_path(self.model):
            _check_cached(self.model)
        self.loop = BackgroundLoop("patchkit-vllm")
        weakref.finalize(self, self.loop.close)
        self.engine, self.tokenizer, self.context = self.loop.run(self._start_engine())
        self.context_fix = "lower max_tokens" + (f", or raise max_model_len ({self.context})" if self.max_model_len else "")

    async def _start_engine(self) -> tuple[Any, Any, int]:
        # On the loop that will run it: the engine starts its output handler on the loop it is first used from.
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        engine = AsyncLLMEngine.from_engine_args(
            AsyncEngineArgs(
                model=self.model,
                dtype=self.dtype,
                seed=self.sampling.seed,
                gpu_memory_utilization=self.gpu_memory_utilization,
                max_model_len=self.max_model_len,
                tensor_parallel_size=self.tensor_parallel_size,
            )
        )
        tokenizer = await _maybe_awaited(engine.get_tokenizer())  # a coroutine in most versions, a value in some
        config = await _maybe_awaited(engine.get_model_config())
        return engine, tokenizer, int(config.max_model_len)

    @make(stream=True, max_concurrency=MAX_CONCURRENCY, read_only=True)
    def generate(  # type: ignore[override]
        self, prompt: str, docs: list[Any] | None = None, max_tokens: int | None = None,
        options: CallOptions | None = None,
    ) -> Iterator[str | CallReport]:
        """Stream the answer as the engine makes it, then its `CallReport` (the engine's counts and logprobs).

        `options` (where this call answers a request) become the request's `SamplingParams`, over this
        generator's settings. Called in a thread of its own for each call, while the engine batches every
        request in flight between its steps.
        """
        from vllm import SamplingParams

        request = self.request(prompt, docs, max_tokens, options)
        prompt_ids = self._prompt_ids(request.messages)
        self.check_length(len(prompt_ids), request.max_tokens, self.context, self.context_fix)
        params = SamplingParams(**self.sampling.applied(request.options).keywords(request.max_tokens),
                                **_vllm_options(request.options))
        ended: dict[str, Any] = {}
        yield from stripped(self.loop.iterate(self._deltas(prompt_ids, params, ended)))
        yield CallReport(len(prompt_ids), ended.get("tokens", 0), ended.get("finish_reason") or "stop",
                         ended.get("logprobs"))

    def check_health(self) -> None:
        """Raise when the engine's loop thread stopped or the engine reports itself dead (its core process gone)."""
        loop: BackgroundLoop | None = self.__dict__.get("loop")
        if loop is None:
            return
        if not loop.alive():
            raise RuntimeError("the vLLM engine's event loop thread has stopped")
        loop.run(self.engine.check_health(), HEALTH_TIMEOUT_S)

    async def _deltas(self, prompt_ids: list[int], params: Any, ended: dict[str, Any]) -> AsyncIterator[str]:
        """The new text of one request as the engine's outputs grow, on the loop.

        What its last output said of it (tokens made, finish_reason, logprobs) goes in `ended`. Aborted in the
        engine when its consumer stops reading first (the task running it is cancelled).
        """
        request_id = uuid.uuid4().hex
        text, finished = "", False
        try:
            async for output in self.engine.generate({"prompt_token_ids": prompt_ids}, params, request_id):
                made = output.outputs[0]
                grown = str(made.text)  # all the text so far: the default (cumulative) output kind
                if len(grown) > len(text):
                    yield grown[len(text) :]
                    text = grown
                ended.update(tokens=len(made.token_ids), finish_reason=made.finish_reason,
                             logprobs=_logprobs(made.logprobs, made.token_ids))
            finished = True
        finally:
            if not finished:
                await self.engine.abort(request_id)

    def _prompt_ids(self, conversation: list[dict[str, str]]) -> list[int]:
        # As LLM.chat makes them: the rendered template, encoded without adding special tokens again.
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False)
        return ids


def _vllm_options(options: CallOptions) -> dict[str, Any]:
    """The call options `SamplingParams` takes under its own names (those of the generator's settings aside)."""
    given: dict[str, Any] = {name: getattr(options, name) for name in ("presence_penalty", "frequency_penalty",
                                                                       "min_tokens") if getattr(options, name)}
    if options.stop:
        given["stop"] = list(options.stop)
    if options.ignore_eos:
        given["ignore_eos"] = True
    if options.logprobs:
        given["logprobs"] = options.top_logprobs or 0
    return given


def _logprobs(logprobs: Any, token_ids: Any) -> list[dict[str, Any]] | None:
    """VLLM's per-token logprobs (a dict of token id to `Logprob` per position) as OpenAI's content entries."""
    if not logprobs:
        return None
    entries = []
    for token, ranked in zip(token_ids, logprobs):
        chosen = ranked.get(token)
        top = sorted(ranked.values(), key=lambda p: p.rank if p.rank is not None else 0)
        entries.append({"token": getattr(chosen, "decoded_token", None) or "",
                        "logprob": float(chosen.logprob) if chosen is not None else None,
                        "bytes": None,
                        "top_logprobs": [{"token": p.decoded_token or "", "logprob": float(p.logprob), "bytes": None}
                                         for p in top]})
    return entries


async def _maybe_awaited(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _looks_like_path(model: str) -> bool:
    """A filesystem path rather than a Hugging Face id ("org/name")."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1 or Path(model).expanduser().exists()


def _cuda_visible() -> bool:
    try:
        import torch
    except ImportError:  # no torch, so no vllm either: that is reported next, once a GPU is there
        return shutil.which("nvidia-smi") is not None
    return bool(torch.cuda.is_available())


def _check_cached(model_id: str) -> None:
    """FileNotFoundError when the Hugging Face id `model_id` is not in the local cache."""
    from huggingface_hub import try_to_load_from_cache

    if not isinstance(try_to_load_from_cache(model_id, "config.json"), str):
        raise FileNotFoundError(
            f"model {model_id!r} is not in the local Hugging Face cache and VLLMGenerator downloads nothing; fetch it "
            f"first (huggingface-cli download {model_id}) or pass the path of a local model directory"
        )
