"""The llama.cpp engine behind LlamaCppGenerator: decoding throughput by concurrency, and prompt reuse.

    python benchmarks/generator_engine.py --threads 1

Model: SmolLM2-135M-Instruct Q4_1 (the bundled GGUF), greedy. Part 1 submits N story prompts at once
straight to the engine (N = 1, 4, 8, 16; max_tokens 64 each, after one warm-up call) and reports the
generated tokens per second of time spent in decode steps (`decode_s`), the mean sequences per step,
the tokens each sequence made (64 unless it ended early),
and tokens per second end to end (prompts included). Part 2 runs a CRAG-style grader call and then the
answer over the same three documents, and reports each call's prompt tokens evaluated and reused,
with the prefix cache and without it, and the tokens per second of its prompt evaluation: the rate
that batched decoding approaches when it is bound by compute.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from patchkit.components.blocks import Grader
from patchkit.components.documents import Hit
from patchkit.components.generators import LlamaCppGenerator

DOCS = [
    Hit("topic:try#0", "try", "The try statement specifies exception handlers and/or cleanup code for a group of "
        "statements. An except clause names the exception classes it handles; the first matching clause runs.", 0.9),
    Hit("topic:except#1", "exceptions", "User code can raise built-in exceptions. A bare except clause handles every "
        "exception, including KeyboardInterrupt, so catching Exception is usually preferred.", 0.8),
    Hit("module:traceback#0", "traceback", "This module provides a standard interface to extract, format and print "
        "stack traces of Python programs, as the interpreter does when it prints a traceback.", 0.6),
]
TOPICS = ("dragon", "robot", "sailor", "baker", "wizard", "pirate", "gardener", "astronaut")
QUESTION = "How do I catch an exception in Python?"


def decode_rates(llm: LlamaCppGenerator, concurrency: int) -> dict[str, float]:
    engine = llm.engine
    assert engine is not None
    asks = [f"Write a long story about a {TOPICS[i % len(TOPICS)]}." for i in range(concurrency)]
    prompts = [llm.tokens(llm.messages(ask)) for ask in asks]
    before, began = engine.stats(), time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda p: b"".join(engine.submit(p, 64).pieces()), prompts))
    wall, after = time.perf_counter() - began, engine.stats()
    delta = {k: after[k] - before[k] for k in ("generated_tokens", "decoded_sequences", "decode_steps", "decode_s")}
    return {
        "decode_tok_s": delta["decoded_sequences"] / delta["decode_s"],
        "mean_active": delta["decoded_sequences"] / delta["decode_steps"],
        "end_to_end_tok_s": delta["generated_tokens"] / wall,
        "tokens_per_sequence": delta["generated_tokens"] / concurrency,
    }


def reuse_pair(llm: LlamaCppGenerator) -> list[tuple[str, Any, Any, float]]:
    engine = llm.engine
    assert engine is not None
    rows = []
    for name, call in [("grade", lambda: Grader(llm).grade(QUESTION, DOCS)), ("answer", lambda: llm.generate(QUESTION, DOCS))]:
        before = engine.stats()
        call()
        after = engine.stats()
        counters = ("prompt_tokens_evaluated", "prompt_tokens_reused", "prefill_s")
        evaluated, reused, seconds = (after[k] - before[k] for k in counters)
        rows.append((name, evaluated, reused, evaluated / seconds))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    llm = LlamaCppGenerator(threads=args.threads)
    llm.setup()
    llm.generate("Warm up.", max_tokens=8)
    print(f"{'sequences':>9} {'decode tok/s':>12} {'mean active':>11} {'tokens/seq':>10} {'end-to-end tok/s':>16}")
    for concurrency in (1, 4, 8, 16):
        rates = decode_rates(llm, concurrency)
        print(f"{concurrency:>9} {rates['decode_tok_s']:>12.1f} {rates['mean_active']:>11.2f} "
              f"{rates['tokens_per_sequence']:>10.1f} {rates['end_to_end_tok_s']:>16.1f}")
    print(f"\n{'cache':>5} {'call':>6} {'evaluated':>9} {'reused':>6} {'prompt tok/s':>12}")
    for cache in (True, False):
        pair = LlamaCppGenerator(threads=args.threads, prefix_cache=cache)
        pair.setup()
        for name, evaluated, reused, rate in reuse_pair(pair):
            print(f"{'on' if cache else 'off':>5} {name:>6} {evaluated:>9} {reused:>6} {rate:>12.1f}")


if __name__ == "__main__":
    main()
