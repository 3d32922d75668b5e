"""`VLLMGenerator`: a chat model on NVIDIA GPUs through vLLM's offline engine, whose continuous
batching takes a whole batch of prompts at once."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from patchkit.component import make
from patchkit.components.generators.base import DEFAULT_SYSTEM_PROMPT, Generator

__all__ = ["VLLMGenerator"]


class VLLMGenerator(Generator):
    """A chat model served in-process by vLLM's `LLM` engine, on one or more NVIDIA GPUs.

    `model`: a local model directory, or the Hugging Face id of a model already in the local
    Hugging Face cache; nothing is downloaded (fetch it first, as `huggingface-cli download ID`).
    `gpu_memory_utilization`: the share of each GPU's memory vLLM takes for weights and KV cache.
    `max_model_len`: the context, in tokens (default: the model's own). `dtype`: "auto" (the
    checkpoint's, float16 where that is float32), "float16", "bfloat16" or "float32".
    `tensor_parallel_size`: GPUs to shard the model over.

    `generate(prompt, docs=None, max_tokens=None)` answers one prompt in pipeline code, as every
    Generator; a deployment hands up to 64 prompts to the engine at once. Greedy at temperature 0;
    above it, each prompt samples with its own generator seeded with `seed`.
    """

    devices = ("gpu",)

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

    def setup(self) -> None:
        """Start the engine on the GPUs this process sees, from local files only."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files are all we read: never the network
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        if not _cuda_visible():
            raise RuntimeError(
                "VLLMGenerator needs an NVIDIA GPU, and this process sees none (no driver, a CPU build of torch, or "
                "CUDA_VISIBLE_DEVICES hides them); use TransformersGenerator or LlamaCppGenerator on CPU"
            )
        try:
            from vllm import LLM
        except ImportError as exc:
            raise ImportError(f"VLLMGenerator needs vllm, which is not installed: pip install 'patchkit[gpu]' ({exc})") from exc
        if not _looks_like_path(self.model):
            _check_cached(self.model)
        self.llm = LLM(
            model=self.model,
            dtype=self.dtype,
            seed=self.sampling.seed,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_len,
            tensor_parallel_size=self.tensor_parallel_size,
        )
        self.tokenizer = self.llm.get_tokenizer()
        self.context: int = self.llm.llm_engine.model_config.max_model_len
        self.context_fix = "lower max_tokens" + (f", or raise max_model_len ({self.context})" if self.max_model_len else "")

    @make(batch=True, max_batch_size=64)
    def generate(  # type: ignore[override]
        self, prompt: list[str], docs: list[list[Any] | None] = None, max_tokens: list[int | None] = None  # type: ignore[assignment]
    ) -> list[str]:
        from vllm import SamplingParams

        requests = self.requests(prompt, docs, max_tokens)
        for request in requests:
            self.check_length(self._prompt_tokens(request.messages), request.max_tokens, self.context, self.context_fix)
        conversations = [request.messages for request in requests]
        params = [SamplingParams(**self.sampling.keywords(request.max_tokens)) for request in requests]
        outputs = self.llm.chat(conversations, sampling_params=params, use_tqdm=False)
        return [str(output.outputs[0].text).strip() for output in outputs]

    def _prompt_tokens(self, conversation: list[dict[str, str]]) -> int:
        # As LLM.chat counts them: the rendered template, encoded without adding special tokens again.
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return len(self.tokenizer.encode(text, add_special_tokens=False))


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
