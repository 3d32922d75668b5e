"""How a GGUF model is loaded through llama.cpp: the one place that decides its load parameters.

llama.cpp repacks a model's weights at load into "extra buffer types" the CPU runs faster: interleaved
blocks for AVX2/AVX-512 and, where the CPU reports AMX (Intel Sapphire Rapids and later), an AMX buffer
("load_tensors: AMX model buffer size = ..."). The AMX path segfaults in the first decode of a Q4/Q8
model (`ggml_backend_amx_mul_mat`, llama.cpp issue 20824), killing the process. So on a CPU that reports
AMX the weights load without extra buffer types (`use_extra_bufts = False`: llama.cpp's plain CPU
kernels, the same answers), and elsewhere with them, as llama.cpp's default. `repack=True` or `False`
forces either way.

Every loader goes through `choose_repack`: the engine (`model_params`), code that uses llama-cpp-python's
own `Llama` class (`open_llama`: the benchmarks' baselines, the tests' references), and a module run as a
program that loads through `Llama`, such as llama-cpp-python's OpenAI-compatible server:

    python -m patchkit.components.generators.llama.loading llama_cpp.server --model model.gguf ...
"""

from __future__ import annotations

import contextlib
import logging
import runpy
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from patchkit.cpu import AMX_FLAGS, cpu_flags

__all__ = ["Repack", "RepackChoice", "apply_repack", "choose_repack", "model_params", "open_llama", "run_module"]

logger = logging.getLogger(__name__)

Repack = bool | Literal["auto"]

_DEFAULTS_LOCK = threading.Lock()  # `open_llama` swaps llama-cpp-python's default model parameters while it loads


@dataclass(frozen=True)
class RepackChoice:
    """Whether a model's weights are repacked into llama.cpp's extra buffer types (`repack`), why, and
    whether the CPU reports AMX (`amx`)."""

    repack: bool
    why: str
    amx: bool = False

    def log(self, model_path: str) -> None:
        """Say the choice in the loading process's log: a warning where AMX is involved (repacking off, so the
        plain kernels run; or forced on, where the first decode may crash), else at info."""
        level = logging.WARNING if self.amx else logging.INFO
        logger.log(level, "llama.cpp loads %s with weight repacking %s", model_path, self.describe())

    def describe(self) -> str:
        """As the worker's log and `stats()` say it: "off (the CPU reports AMX: ...)"."""
        return f"{'on' if self.repack else 'off'} ({self.why})"


def choose_repack(repack: Repack = "auto", flags: frozenset[str] | None = None) -> RepackChoice:
    """Whether to load with extra buffer types: off where the CPU reports AMX, on elsewhere ("auto"), or as forced.

    Args:
        repack: "auto", or True / False to force repacking on or off.
        flags: the CPU's flags (default: `patchkit.cpu.cpu_flags()`, which `PATCHKIT_CPU_FLAGS` overrides).

    Raises:
        ValueError: `repack` is neither "auto" nor a bool.
    """
    if not (repack is True or repack is False or repack == "auto"):
        raise ValueError(f"repack ({repack!r}) must be 'auto', True or False")
    amx = sorted((cpu_flags() if flags is None else flags) & AMX_FLAGS)
    if repack is True and amx:
        return RepackChoice(True, "repack=True was given; the CPU reports AMX, where llama.cpp's first decode may crash",
                            amx=True)
    if repack is True or repack is False:
        return RepackChoice(repack, f"repack={repack} was given", amx=bool(amx))
    if amx:
        return RepackChoice(False, f"the CPU reports AMX ({', '.join(amx)}), whose repacked weights crash llama.cpp",
                            amx=True)
    return RepackChoice(True, "the CPU reports no AMX")


def model_params(lib: Any, choice: RepackChoice) -> Any:
    """llama.cpp's default model parameters (`lib` is the `llama_cpp` module) with `choice` applied."""
    return apply_repack(lib.llama_model_default_params(), choice)


def apply_repack(params: Any, choice: RepackChoice) -> Any:
    """`params` (a `llama_model_params`) with its `use_extra_bufts` set as `choice` says.

    A llama-cpp-python older than 0.3.15 has no such field, and ctypes would take the assignment as a plain
    attribute: the weights would be repacked whatever `choice` says, and on an AMX CPU the first decode would
    crash. So where repacking must be off and the field is missing, this raises instead.

    Raises:
        RuntimeError: repacking must be off and the installed llama-cpp-python cannot turn it off.
    """
    if "use_extra_bufts" in (name for name, *_ in type(params)._fields_):
        params.use_extra_bufts = choice.repack
    elif not choice.repack:
        raise RuntimeError(
            f"llama.cpp must load without weight repacking here ({choice.why}), but the installed llama-cpp-python "
            f"has no use_extra_bufts parameter: install llama-cpp-python>=0.3.15 (pip install -U llama-cpp-python)")
    return params


def open_llama(model_path: str, *, repack: Repack = "auto", **kwargs: Any) -> Any:
    """`llama_cpp.Llama(model_path, **kwargs)`, loaded with the repack `choose_repack(repack)` makes.

    `Llama` takes no parameter for extra buffer types, so its default model parameters are swapped for
    the duration of the load (one load at a time through here); the model is the one `Llama` loads,
    its other parameters untouched. Where repacking is on, this is plain `Llama(...)`.
    """
    from llama_cpp import Llama

    choice = choose_repack(repack)
    choice.log(model_path)
    if choice.repack:
        return Llama(model_path=model_path, **kwargs)
    with _default_params(choice):
        return Llama(model_path=model_path, **kwargs)


def run_module(module: str, args: list[str], repack: Repack = "auto") -> None:
    """Run `python -m module *args` in this process, every model it loads through `Llama` loaded with the
    repack `choose_repack(repack)` makes (`module`: e.g. `llama_cpp.server`, OpenAIGenerator's usual server)."""
    choice = choose_repack(repack)
    logger.warning("%s loads its models with weight repacking %s", module, choice.describe())
    sys.argv = [module, *args]
    with _default_params(choice):
        runpy.run_module(module, run_name="__main__", alter_sys=True)


@contextlib.contextmanager
def _default_params(choice: RepackChoice) -> Iterator[None]:
    from llama_cpp import llama_cpp as lib

    original = lib.llama_model_default_params

    def defaults() -> Any:
        return apply_repack(original(), choice)

    with _DEFAULTS_LOCK:
        lib.llama_model_default_params = defaults
        try:
            yield
        finally:
            lib.llama_model_default_params = original


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit("usage: python -m patchkit.components.generators.llama.loading MODULE [ARGS...]")
    logging.basicConfig(level=logging.WARNING)
    run_module(sys.argv[1], sys.argv[2:])
