"""How long the document KV cache holds up the llama.cpp engine's decode loop.

    PYTHONPATH=. python benchmarks/kv_stall.py --json kv-stall.json
    PYTHONPATH=/path/to/another/checkout python benchmarks/kv_stall.py   # the same, on another version

One long answer decodes from start to end while prompts over pydoc documents arrive one after another
beside it, on an engine of two running slots and no cache slots, so that every prompt takes the slot
of the one before and the document cache saves and restores its documents. The engine thread runs
the cache's `save` and `restore` between decode steps: each call's time on that thread is a stall of
every running sequence. Reported: the calls, their mean, median and longest time, their share of the run,
and the gaps between the long answer's tokens (a decode step, plus the prompt evaluation and the
cache calls of its turn). Greedy answers are compared with an engine without the document cache.

    PYTHONPATH=. python benchmarks/kv_stall.py --kv-reuse blend --max-sequences 16 --cache-slots 8

With `--kv-reuse blend`, the engine places each document's cells wherever the prompt has it
(`kv_blend.py`): also reported are the placings (their time on the engine thread, the slot state's
bytes they copy) and the prompt evaluation's time per token, which holds what llama.cpp does at
the decode after a placing (its K-shift of the whole context, where the engine leaves the move to
it). `--max-sequences` and `--cache-slots` size the engine as LlamaCppGenerator does (16 and 8):
the context's cells are theirs.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patchkit.components.documents import pydoc_corpus
from patchkit.components.generators import LlamaCppGenerator
from patchkit.components.generators.llama.engine import EngineConfig, LlamaEngine

LONG = "Count from 1 to 1000, separated by commas."


def timed(calls: list[float], method: Callable[..., Any]) -> Callable[..., Any]:
    """`method`, its every call's duration appended to `calls`."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            calls.append(time.perf_counter() - began)
    return wrapper


def workload(count: int, pool: int, seed: int) -> list[tuple[str, list[Any]]]:
    """`count` questions over three documents each, drawn from `pool` pydoc chunks of 100 words or more."""
    docs = [d for d in pydoc_corpus() if len(d.text.split()) >= 100][:pool]
    rng = random.Random(seed)
    return [(f"What does {d[0].title} do?", d) for d in (rng.sample(docs, 3) for _ in range(count))]


def run(llm: LlamaCppGenerator, calls: list[tuple[str, list[Any]]], budget: int, args: argparse.Namespace) -> dict[str, Any]:
    """The long answer beside `calls`, on an engine with a document cache of `budget` bytes."""
    blend = args.kv_reuse == "blend" and budget > 0
    engine = LlamaEngine(EngineConfig(llm.model_path, n_ctx=2048, max_sequences=args.max_sequences,
                                      cache_slots=args.cache_slots, threads=args.threads, kv_cache_bytes=budget,
                                      kv_reuse="blend" if blend else "exact"))
    saves: list[float] = []
    restores: list[float] = []
    placings: list[float] = []
    cache = engine._documents
    cache.save = timed(saves, cache.save)  # type: ignore[method-assign]
    cache.restore = timed(restores, cache.restore)  # type: ignore[method-assign]
    if engine._blender is not None:
        engine._blender.place = timed(placings, engine._blender.place)  # type: ignore[method-assign]
    arrivals: list[float] = []
    answers: list[bytes] = []
    try:
        long = engine.submit(llm.tokens(llm.messages(LONG)), 1500)

        def follow() -> None:
            for _ in long.pieces():
                arrivals.append(time.perf_counter())

        follower = threading.Thread(target=follow)
        follower.start()
        while not arrivals:
            time.sleep(0.01)
        began = time.perf_counter()
        for question, docs in calls:
            tokens, pieces = llm.prompt(llm.messages(question, docs), docs)
            bodies = llm.bodies(tokens, pieces, docs) if blend else []
            answers.append(b"".join(engine.submit(tokens, 24, pieces=pieces, documents=bodies).pieces()))
        wall = time.perf_counter() - began
        long.close()
        follower.join()
        stats = engine.stats()
    finally:
        engine.close()
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if began <= a and b <= began + wall]
    ops = saves + restores
    return {
        "wall_s": wall, "saves": len(saves), "restores": len(restores),
        "save_ms_mean": 1e3 * statistics.fmean(saves) if saves else 0.0,
        "save_ms_median": 1e3 * statistics.median(saves) if saves else 0.0, "save_ms_max": 1e3 * max(saves, default=0.0),
        "restore_ms_mean": 1e3 * statistics.fmean(restores) if restores else 0.0,
        "restore_ms_median": 1e3 * statistics.median(restores) if restores else 0.0,
        "restore_ms_max": 1e3 * max(restores, default=0.0),
        "cache_share": sum(ops) / wall, "gap_ms_mean": 1e3 * statistics.fmean(during),
        "gap_ms_p95": 1e3 * sorted(during)[int(0.95 * (len(during) - 1))], "gap_ms_max": 1e3 * max(during),
        "tokens_restored": stats.get("kv_cache_tokens_saved", 0), "answers": [a.decode(errors="replace") for a in answers],
        "placings": len(placings), "place_ms_mean": 1e3 * statistics.fmean(placings) if placings else 0.0,
        "place_ms_max": 1e3 * max(placings, default=0.0),
        "place_state_mb_mean": stats.get("blend_state_bytes", 0) / 1e6 / max(1, len(placings)),
        "context_shifts": stats.get("blend_context_shifts", len(placings) if placings else 0),
        "prefill_ms_per_token": 1e3 * stats["prefill_s"] / max(1, stats["prompt_tokens_evaluated"]),
        "prompt_tokens_evaluated": stats["prompt_tokens_evaluated"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=24, help="questions beside the long answer")
    parser.add_argument("--pool", type=int, default=6, help="documents the questions draw from")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument("--kv-reuse", choices=("exact", "blend"), default="exact")
    parser.add_argument("--max-sequences", type=int, default=2)
    parser.add_argument("--cache-slots", type=int, default=0)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    llm = LlamaCppGenerator(threads=args.threads)
    llm.setup()
    assert llm.engine is not None
    llm.engine.close()  # only its tokenizer and chat template are used
    calls = workload(args.count, args.pool, args.seed)
    cached = run(llm, calls, args.kv_cache_bytes, args)
    plain = run(llm, calls, 0, args)
    import patchkit

    print(f"patchkit from {Path(patchkit.__file__).parent}; {args.count} questions over {args.pool} documents")
    print("| document cache | saves | save ms (mean / median / max) | restores | restore ms (mean / median / max) "
          "| share of the run "
          "| token gap ms (mean / p95 / max) | tokens restored |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, found in (("on", cached), ("off", plain)):
        print(f"| {name} | {found['saves']} | {found['save_ms_mean']:.1f} / {found['save_ms_median']:.1f} / "
              f"{found['save_ms_max']:.1f} | {found['restores']} | {found['restore_ms_mean']:.1f} / "
              f"{found['restore_ms_median']:.1f} / {found['restore_ms_max']:.1f} "
              f"| {100 * found['cache_share']:.1f}% | {found['gap_ms_mean']:.0f} / {found['gap_ms_p95']:.0f} / "
              f"{found['gap_ms_max']:.0f} | {found['tokens_restored']:,} |")
    if cached["placings"]:
        print(f"\n| placings | place ms (mean / max) | slot state copied per placing, MB | left to llama.cpp's shift "
              "| prefill ms per token (cache on / off) | prompt tokens evaluated (on / off) |\n"
              "| --- | --- | --- | --- | --- | --- |\n"
              f"| {cached['placings']} | {cached['place_ms_mean']:.1f} / {cached['place_ms_max']:.1f} "
              f"| {cached['place_state_mb_mean']:.1f} | {cached['context_shifts']} "
              f"| {cached['prefill_ms_per_token']:.2f} / {plain['prefill_ms_per_token']:.2f} "
              f"| {cached['prompt_tokens_evaluated']:,} / {plain['prompt_tokens_evaluated']:,} |")
    same = sum(a == b for a, b in zip(cached["answers"], plain["answers"]))
    print(f"answers identical with and without the cache: {same}/{len(calls)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "cached": cached, "plain": plain}, indent=1))


if __name__ == "__main__":
    main()
