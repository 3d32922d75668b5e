"""What prefix reuse could save on the real-model stream, replayed without a model.

    python benchmarks/prefix_replay.py --count 256 --rates rag-stream.json
    python benchmarks/prefix_replay.py --items topics24.json   # a blend_served.py --save-items stream

`benchmarks/rag_stream.py` measures the document KV cache on the engines; this replays the same
stream's prompts (the same questions, retrieved documents and tokens) through the engines' reuse
rules alone, each policy at its best: prompts arrive one at a time (none evaluated twice because
another was in flight), each goes to the engine that served its first document before (the least
loaded for a new one), and the document cache holds everything (no byte budget). Per engine:

- `slots`: the engine's slots keep its last `--slots` prompts (the running slots and the cache
  slots, 16 + 8 for `LlamaCppGenerator`); a prompt reuses the longest prefix a slot holds;
- `slots + document cache`: besides, the path of pieces (the system prompt, then each document in
  order) of every prompt the engine evaluated; a prompt reuses the longer of the two;
- `perfect`: every prefix any earlier prompt of the stream shares, on one engine, token by token;
- `blend` (`kv_reuse="blend"`, at each `--ratios` share): besides the slots and the document cache,
  every document body the engine evaluated before, wherever it stood: a document after the reused
  prefix evaluates only its label and the recompute share of its body; the first time, its body is
  evaluated in place, with the prompt, and its cells kept (`kv_blend.py`, on a model whose keys turn
  on the host, as SmolLM2's do); the rest of the prompt is evaluated.

Reuse ends at a `--block` boundary (the engine evaluates prompts in blocks aligned to position 0,
so that reuse changes no answer) and spares the last prompt token (its logits start the answer).
With the engines' prompt and decode rates (from a rag_stream `--json` file, or the flags), each
policy's time is its tokens evaluated plus its decoding, split over the engines; the ratio of the
`slots` time to the others' is the most a document cache, and any prefix reuse at all, could add
over an engine whose slots already reuse prefixes.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.question_stream import unshared_tokens  # noqa: E402
from patchkit.components.generators.llama.kv_blend import recomputed  # noqa: E402
from patchkit.components.generators.llama.sequence import common_prefix  # noqa: E402

__all__ = ["Engine", "replay"]

Prompt = tuple[Sequence[int], Sequence[int], Sequence[tuple[int, int]]]  # tokens, where pieces end, document bodies


@dataclass
class Engine:
    """One engine's reuse: the prompts its slots hold, least recently used first, and its document cache's
    paths (each a prompt's leading pieces, mapped to the tokens they cover)."""

    slots: int
    documents: bool
    blend: float | None = None  # the recompute share under kv_reuse="blend"; None: exact reuse only
    held: list[Sequence[int]] = field(default_factory=list)
    paths: dict[tuple[tuple[int, ...], ...], int] = field(default_factory=dict)
    bodies: set[tuple[int, ...]] = field(default_factory=set)
    work: int = 0

    def serve(self, prompt: Prompt, block: int) -> int:
        """Place `prompt` as the engine does and keep it; the tokens it evaluates. Reuse ends at a block
        boundary and spares the last token. The prompt takes the slot holding the longest such prefix, or
        the least recently used slot (an empty one while any is left) when none holds one or the
        document cache holds more."""
        tokens = prompt[0]
        limit = len(tokens) - 1 - (len(tokens) - 1) % block

        def aligned(n: int) -> int:
            return min(limit, n) - min(limit, n) % block

        lengths = [aligned(common_prefix(tokens, kept)) for kept in self.held]
        slot = max(range(len(lengths)), key=lengths.__getitem__, default=None)
        reused, cached = (lengths[slot] if slot is not None else 0), aligned(self.cached(prompt))
        if cached > reused or not reused:  # the least recently used slot: an empty one while any is left
            slot = 0 if len(self.held) >= self.slots else None
            reused = max(cached, reused)
        if slot is not None:
            del self.held[slot]
        self.held.append(tokens)
        self.remember(prompt)
        evaluated = len(tokens) - reused - self.placed(prompt, reused)
        self.work += evaluated
        return evaluated

    def placed(self, prompt: Prompt, reused: int) -> int:
        """Under blend, the prompt tokens its documents' cells spare: a body held is placed, one not held
        is evaluated in place and kept (as `Blender.plan` and `Blender.keep_in_place` do); 0 under exact reuse."""
        if self.blend is None:
            return 0
        tokens, _, bodies = prompt
        spared, after = 0, reused
        for start, end in bodies:
            if start < after:
                continue
            at = start + recomputed(end - start, self.blend)
            at += at == after
            if at >= end:
                continue
            body = tuple(tokens[start:end])
            if body not in self.bodies:
                self.bodies.add(body)
                continue
            spared += end - at
            after = end
        return spared

    def cached(self, prompt: Prompt) -> int:
        """The tokens of the longest path of the prompt's pieces the document cache holds."""
        held = (self.paths.get(path, 0) for path in self.pieces(prompt)) if self.documents else iter(())
        return max(held, default=0)

    def remember(self, prompt: Prompt) -> None:
        """Keep the prompt's paths of pieces in the document cache, if the engine has one."""
        if self.documents:
            for path in self.pieces(prompt):
                self.paths[path] = sum(map(len, path))

    @staticmethod
    def pieces(prompt: Prompt) -> list[tuple[tuple[int, ...], ...]]:
        """The prompt's leading paths of pieces, shortest first."""
        tokens, ends = prompt[0], prompt[1]
        cuts = list(zip([0, *ends], ends))
        return [tuple(tuple(tokens[a:b]) for a, b in cuts[: depth + 1]) for depth in range(len(cuts))]


def replay(prompts: Sequence[Prompt], *, engines: int, slots: int, documents: bool, block: int,
           blend: float | None = None) -> list[int]:
    """Per prompt, in stream order, the tokens its engine evaluates under the policy (see the module's
    docstring); a prompt goes to the engine that last served its first document, else the least loaded."""
    if min(engines, slots, block) < 1:
        raise ValueError(f"engines ({engines}), slots ({slots}) and block ({block}) must be >= 1")
    fleet = [Engine(slots, documents, blend) for _ in range(engines)]
    holders: dict[tuple[int, ...], Engine] = {}
    evaluated = []
    for prompt in prompts:
        tokens, ends = prompt[0], prompt[1]
        key = tuple(tokens[: ends[1] if len(ends) > 1 else len(tokens)])
        engine = holders.get(key) or min(fleet, key=lambda e: e.work)
        holders[key] = engine
        evaluated.append(engine.serve(prompt, block))
    return evaluated


def seconds(evaluated: int, questions: int, rates: dict[str, float], engines: int) -> float:
    """The time `engines` engines take to evaluate `evaluated` prompt tokens and decode the answers of
    `questions` questions, at `rates` (per engine: prompt tok/s, batched decode tok/s, generated tokens a question)."""
    return (evaluated / rates["prompt_tok_s"] + questions * rates["generated"] / rates["decode_tok_s"]) / engines


def rates_of(args: argparse.Namespace) -> dict[str, float]:
    """The engines' rates: from a rag_stream `--json` run (its 1-thread engines' rates and the answers'
    length) when given, else the flags."""
    if not args.rates:
        return {"prompt_tok_s": args.prompt_rate, "decode_tok_s": args.decode_rate, "generated": args.generated}
    found = json.loads(Path(args.rates).read_text())
    layout = next(x for x in found["bound"]["layouts"] if int(x["threads"]) == 1)
    return {"prompt_tok_s": layout["prompt_tok_s"], "decode_tok_s": layout["decode_tok_s_batched"],
            "generated": found["workload"]["generated_tokens"]}


def stream_prompts(args: argparse.Namespace) -> tuple[list[Prompt], str]:
    """The rag_stream stream's first `--count` prompts, as its engines tokenize them (with their documents'
    bodies, as `LlamaCppGenerator.bodies` finds them), and its skew."""
    from benchmarks.rag_stream import PlainRetriever, measure_stream, tokenized
    from patchkit.components.documents import pydoc_corpus
    from patchkit.components.generators import LlamaCppGenerator

    docs = pydoc_corpus()
    questions, _, retrieved, described = measure_stream(args, docs, PlainRetriever(docs, args.topk))
    tokenizer = LlamaCppGenerator(n_ctx=args.n_ctx, threads=1)
    tokenizer.setup()
    try:
        prompts = [(t, e, tokenizer.bodies(t, e, d)) for (t, e), d in zip(tokenized(args, questions, retrieved), retrieved)]
    finally:
        assert tokenizer.engine is not None
        tokenizer.engine.close()
    return prompts, described["document_popularity"]


def item_prompts(items: Sequence[dict[str, Any]], n_ctx: int = 2048) -> list[Prompt]:
    """The prompts of a `blend_served.py --save-items` stream (each a question and its documents' texts) as
    `LlamaCppGenerator` tokenizes them, with their documents' bodies."""
    from patchkit.components.generators import LlamaCppGenerator

    tokenizer = LlamaCppGenerator(n_ctx=n_ctx, threads=1)
    tokenizer.setup()
    try:
        prompts = []
        for item in items:
            tokens, ends = tokenizer.prompt(tokenizer.messages(item["question"], item["docs"]), item["docs"])
            prompts.append((tokens, ends, tokenizer.bodies(tokens, ends, item["docs"])))
    finally:
        tokenizer.teardown()
    return prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zipf", type=float, default=1.0, help="the Zipf exponent of module popularity")
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--slots", type=int, default=24, help="prompts an engine's slots keep")
    parser.add_argument("--blocks", default="64,32", help="reuse granularities to replay, in tokens")
    parser.add_argument("--rates", help="a rag_stream.py --json file to take the engines' rates from")
    parser.add_argument("--ratios", default="0,0.15,0.3", help="blend's recompute shares to replay")
    parser.add_argument("--prompt-rate", type=float, default=161.0, help="prompt tok/s of one engine")
    parser.add_argument("--decode-rate", type=float, default=101.0, help="batched decode tok/s of one engine")
    parser.add_argument("--generated", type=float, default=62.3, help="tokens generated a question")
    parser.add_argument("--items", help="replay a blend_served.py --save-items stream instead of rag_stream's")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    args.replicas = args.engines  # measure_stream reads the rag_stream flags it shares
    if args.items:
        prompts, skew = item_prompts(json.loads(Path(args.items).read_text()), args.n_ctx), f"the stream of {args.items}"
    else:
        prompts, skew = stream_prompts(args)
    rates, count = rates_of(args), len(prompts)
    total, perfect = sum(len(p[0]) for p in prompts), sum(unshared_tokens([p[0] for p in prompts]))
    ratios = [float(r) for r in args.ratios.split(",") if r]
    rows, found = [], []
    for block in (int(b) for b in args.blocks.split(",")):
        fleet = {"engines": args.engines, "slots": args.slots, "block": block}
        slots = sum(replay(prompts, documents=False, **fleet))
        cached = sum(replay(prompts, documents=True, **fleet))
        blended = {r: sum(replay(prompts, documents=True, blend=r, **fleet)) for r in ratios}
        base = seconds(slots, count, rates, args.engines)
        cache_gain = base / seconds(cached, count, rates, args.engines)
        perfect_gain = base / seconds(perfect, count, rates, args.engines)
        blend_gain = {r: seconds(cached, count, rates, args.engines) / seconds(n, count, rates, args.engines)
                      for r, n in blended.items()}
        found.append({"block": block, "slots": slots, "document_cache": cached, "perfect": perfect,
                      "document_cache_gain": cache_gain, "perfect_gain": perfect_gain,
                      "blend": {str(r): n for r, n in blended.items()},
                      "blend_gain_over_document_cache": {str(r): g for r, g in blend_gain.items()}})
        cells = " | ".join(f"{blended[r]:,} ({blend_gain[r]:.2f}x)" for r in ratios)
        rows.append(f"| {block} | {slots:,} | {cached:,} | {perfect:,} | {cache_gain:.2f}x | {perfect_gain:.2f}x | {cells} |")
    print(f"{count} prompts, {total:,} tokens; documents: {skew}")
    print(f"rates per engine: {rates['prompt_tok_s']:.0f} prompt tok/s, {rates['decode_tok_s']:.0f} decode tok/s, "
          f"{rates['generated']:.1f} tokens generated a question; {args.engines} engines of {args.slots} slots\n")
    heads = " | ".join(f"blend {r:g} (over the document cache)" for r in ratios)
    print(f"| block | evaluated: slots | slots + document cache | perfect | document cache over slots "
          f"| perfect over slots | {heads} |")
    print("| --- " * (6 + len(ratios)) + "|")
    print("\n".join(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "rates": rates, "total": total, "rows": found}, indent=1))


if __name__ == "__main__":
    main()
