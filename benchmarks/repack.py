"""What loading the model without weight repacking costs: prompt evaluation and decoding tokens/s, repack on and off.

    PYTHONPATH=. python benchmarks/repack.py --json benchmarks/results/repack.json

On a CPU that reports AMX, `LlamaCppGenerator` loads the model with llama.cpp's extra buffer types off
(`repack="auto"`), since their AMX variant crashes the first decode; elsewhere it keeps them. This
measures both loads on this machine (one without AMX: the "on" arm is llama.cpp's default here), each
in a fresh process, alternating, `--runs` times each: a prompt of `--prompt-tokens` evaluated alone (one
answer token), then one answer of `--decode-tokens` tokens decoded alone, then `--sequences` answers
decoded together, all on `--threads` threads with no prefix reuse. Reported per arm: the medians and the
spread of the rates, from the engine's own time inside `llama_decode` (`prefill_s`, `decode_s`), and
the answers' equality (greedy answers do not depend on the kernels' layout where their sums round alike).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Summarise the following notes on Python's data model in one sentence.\n" + " ".join(
    f"Note {i}: objects have an identity, a type and a value; the type decides the operations it supports." for i in range(60)
)


def measure(repack: bool, prompt_tokens: int, decode_tokens: int, sequences: int, threads: int) -> dict[str, Any]:
    """One arm, in this process: the engine's prompt and decode rates with weight repacking `repack`."""
    from patchkit.components.generators.base import default_gguf_path
    from patchkit.components.generators.llama.engine import EngineConfig, LlamaEngine

    engine = LlamaEngine(EngineConfig(str(default_gguf_path()), n_ctx=2048, max_sequences=max(sequences, 1), cache_slots=0,
                                      threads=threads, prefix_cache=False, repack=repack))
    try:
        prompt = engine.tokenize(PROMPT, add_bos=True)[:prompt_tokens]
        before = engine.stats()
        list(engine.submit(prompt, 1).pieces())
        after = engine.stats()
        evaluated = after["prompt_tokens_evaluated"] - before["prompt_tokens_evaluated"]
        prompt_rate = evaluated / (after["prefill_s"] - before["prefill_s"])
        short = engine.tokenize("Count from one to two hundred in words:", add_bos=True)
        one = _decode(engine, [short], decode_tokens)
        many = _decode(engine, [short[:-i] if i else short for i in range(sequences)], decode_tokens)
        return {"repack": repack, "weight_repack": engine.stats()["weight_repack"], "prompt_tokens_per_s": prompt_rate,
                "decode_tokens_per_s_1": one["rate"], f"decode_tokens_per_s_{sequences}": many["rate"],
                "answer": one["answers"][0]}
    finally:
        engine.close()


def _decode(engine: Any, prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    """Decode `tokens` tokens for each of `prompts` at once: generated tokens per second of decode time."""
    before = engine.stats()
    streams = [engine.submit(p, tokens) for p in prompts]
    answers = [b"".join(s.pieces()).decode(errors="replace") for s in streams]
    after = engine.stats()
    generated = after["generated_tokens"] - before["generated_tokens"]
    return {"rate": generated / (after["decode_s"] - before["decode_s"]), "answers": answers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--arm", choices=["on", "off"], help=argparse.SUPPRESS)  # one arm, in a fresh process
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(measure(args.arm == "on", args.prompt_tokens, args.decode_tokens, args.sequences, args.threads)))
        return
    runs: dict[str, list[dict[str, Any]]] = {"on": [], "off": []}
    for _ in range(args.runs):
        for arm in ("on", "off"):
            command = [sys.executable, __file__, "--arm", arm, "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens",
                       str(args.decode_tokens), "--sequences", str(args.sequences), "--threads", str(args.threads)]
            out = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout
            runs[arm].append(json.loads(out.strip().splitlines()[-1]))
    keys = {"prompt_tokens_per_s": "prompt evaluation, tokens/s",
            "decode_tokens_per_s_1": "decoding, 1 sequence, tokens/s",
            f"decode_tokens_per_s_{args.sequences}": f"decoding, {args.sequences} sequences, tokens/s"}
    summary = {arm: {key: _spread([r[key] for r in found]) for key in keys} for arm, found in runs.items()}
    same = sum(a["answer"] == b["answer"] for a, b in zip(runs["on"], runs["off"]))
    rows = [[label, _cell(summary["on"][key]), _cell(summary["off"][key]),
             f"{summary['off'][key]['median'] / summary['on'][key]['median']:.2f}x"] for key, label in keys.items()]
    rows.append(["greedy answers the same", "", f"{same}/{args.runs}", ""])
    result = {
        "title": "llama.cpp weight repacking on and off: prompt and decode rates",
        "components": "real models",
        "machine": f"{_cpu_model()}, {os.cpu_count()} vCPUs, load average {os.getloadavg()[0]:.1f} at the end, "
                   f"Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"), "commit": _commit(),
        "command": "python benchmarks/repack.py " + " ".join(sys.argv[1:]),
        "setup": f"SmolLM2-135M-Instruct Q4_1 in patchkit's llama.cpp engine on {args.threads} thread(s), each arm in a "
                 f"fresh process, alternating, {args.runs} runs each: a {args.prompt_tokens}-token prompt evaluated alone, "
                 f"then {args.decode_tokens} tokens decoded for 1 and for {args.sequences} sequences. Rates from the "
                 "engine's time inside llama_decode. 'on' is llama.cpp's default (extra buffer types); 'off' is what "
                 "repack='auto' loads on a CPU that reports AMX.",
        "tables": [{"caption": "Median (min-max) over the runs; off over on, the medians' ratio.",
                    "columns": ["measure", "repack on (llama.cpp's default)", "repack off (AMX hosts)", "off / on"],
                    "rows": rows}],
        "plots": [{"title": "Median rate, weight repacking on and off", "kind": "bar", "ylabel": "tokens/s",
                   "x": list(keys.values()),
                   "series": {arm_label: [round(summary[arm][key]["median"], 1) for key in keys]
                              for arm, arm_label in (("on", "repack on"), ("off", "repack off"))}}],
        "runs": runs,
    }
    print(json.dumps(result["tables"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def _cell(spread: dict[str, float]) -> str:
    return f"{spread['median']:.1f} ({spread['min']:.1f}-{spread['max']:.1f})"


def _commit() -> str:
    found = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    return found.stdout.strip() or "unknown"


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _cpu_model() -> str:
    from patchkit.cpu import cpu_model

    return cpu_model()


if __name__ == "__main__":
    main()
