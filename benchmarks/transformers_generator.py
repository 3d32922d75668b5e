"""TransformersGenerator's batched decoding: generated tokens/s at 1, 8, 32 and 64 calls at once.

    python benchmarks/transformers_generator.py [--device cuda] [--levels 1,8,32,64] [--max-batch 16,64]

Model: the bundled SmolLM2-135M-Instruct GGUF, dequantized by transformers (float32), greedy. At each
level that many threads call `llm.generate(story prompt)` at the same moment, once each (after one
warm-up call); the engine takes the calls waiting, up to its batch limit, into one left-padded
`model.generate`. Tokens are the engine's own count (`stats()`), over the level's wall time. Each
batch limit in `--max-batch` loads its own generator: 16 is the shipped limit (`MAX_BATCH`), a larger
one shows what a GPU gains from wider batches.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

from patchkit.components.generators import huggingface
from patchkit.components.generators.huggingface import TransformersGenerator
from patchkit.core import ensure_setup
from patchkit.tables import text_table

TOPICS = ("dragon", "robot", "sailor", "baker", "wizard", "pirate", "gardener", "astronaut")


def loaded(device: str, max_tokens: int, max_batch: int) -> tuple[TransformersGenerator, float]:
    """A set-up generator whose engine batches up to `max_batch` calls, and its load time in seconds."""
    shipped = huggingface.MAX_BATCH
    huggingface.MAX_BATCH = max_batch  # setup() sizes the engine from it
    try:
        llm = TransformersGenerator(device=device, max_tokens=max_tokens)
        start = time.perf_counter()
        ensure_setup(llm)
        took = time.perf_counter() - start
    finally:
        huggingface.MAX_BATCH = shipped
    llm.generate("Say hello.")  # warm-up: kernels, caches
    return llm, took


def at_once(llm: TransformersGenerator, calls: int) -> dict[str, float]:
    prompts = [f"Write a short story about a {TOPICS[i % len(TOPICS)]} number {i}." for i in range(calls)]
    before = llm.stats()
    start = time.perf_counter()
    with ThreadPoolExecutor(calls) as pool:
        answers = list(pool.map(llm.generate, prompts))
    elapsed = time.perf_counter() - start
    after = llm.stats()
    done = {key: after[key] - before[key] for key in after}
    assert all(answers), "every call answers"
    return {
        "calls": calls, "seconds": elapsed, "tokens": done["tokens"], "tokens_s": done["tokens"] / elapsed,
        "batches": done["batches"], "rows_per_batch": done["rows"] / max(1, done["batches"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--levels", default="1,8,32,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", default=str(huggingface.MAX_BATCH), help="engine batch limits, comma-separated")
    args = parser.parse_args()
    rows = []
    for max_batch in (int(x) for x in args.max_batch.split(",")):
        llm, took = loaded(args.device, args.max_tokens, max_batch)
        print(f"max batch {max_batch}: loaded on {llm.torch_device} in {took:.1f} s")
        base = None
        for level in (int(x) for x in args.levels.split(",")):
            r = at_once(llm, level)
            base = base or r["tokens_s"]
            rows.append((
                str(max_batch), str(level), f"{r['seconds']:.2f}", f"{r['tokens']:.0f}", f"{r['tokens_s']:.0f}",
                f"{r['tokens_s'] / base:.1f}x", f"{r['batches']:.0f}", f"{r['rows_per_batch']:.1f}",
            ))
    header = ("max batch", "calls at once", "seconds", "tokens", "tokens/s", "vs 1", "batches", "calls per batch")
    print(text_table(header, rows))


if __name__ == "__main__":
    main()
