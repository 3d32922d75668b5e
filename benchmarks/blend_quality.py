"""What blending documents' KV (`kv_reuse="blend"`) costs in answers, against exact prefill, per recompute share.

    python benchmarks/blend_quality.py --ratios 0,0.15,0.3 --json blend-quality.json --plot blend-quality.png \\
        --replay replay.json   # a prefix_replay.py --json result: its speed on the stream, in the plot

The labelled question sets (benchmarks/recall_questions*.json: 20 + 20 + the demo's 8), each question
with its top 3 pydoc chunks from MiniLM over FAISS (as rag_stream.py retrieves), asked in order of one
engine per arm (one slot, the document cache on: a document evaluated once is placed wherever it comes
back). Per arm: greedy answers (`--max-tokens`), then the exact arm's answer teacher-forced after the
same prompt. Reported per recompute share, against the exact arm: (a) answers identical, (b) ROUGE-L
(F1 of the longest common token subsequence) against the exact answers, (c) the mean negative
log-likelihood per token of the exact answer, and its ratio to the exact KV's (how far the attention
drifted, whatever the answer); and the prompt tokens evaluated and the seconds spent evaluating prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.rag_stream import PlainRetriever  # noqa: E402
from patchkit.components.documents import pydoc_corpus  # noqa: E402
from patchkit.components.generators import LlamaCppGenerator  # noqa: E402
from patchkit.components.generators.llama.engine import EngineConfig, LlamaEngine  # noqa: E402
from patchkit.components.generators.llama.sequence import LlamaSequence, cut_pieces  # noqa: E402

SETS = ("recall_questions.json", "recall_questions_fresh.json", "recall_questions_demo.json")


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1 over whitespace tokens."""
    a, b = candidate.split(), reference.split()
    if not a or not b:
        return float(a == b)
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], diagonal + 1 if x == y else max(row[j], row[j - 1])
    common = row[-1]
    return 0.0 if not common else 2 * common / (len(a) + len(b))


class Arm:
    """One engine, driven by hand (its thread stopped) so that every answer token's logits can be read."""

    def __init__(self, llm: LlamaCppGenerator, kv_reuse: str, recompute: float) -> None:
        self.llm, self.greedy = llm, None
        config = EngineConfig(llm.model_path, n_ctx=2048, max_sequences=1, cache_slots=0, threads=llm.threads or 1,
                              kv_cache_bytes=512 << 20, kv_reuse=kv_reuse, recompute=recompute)
        self.engine = engine = LlamaEngine(config)
        engine.stop()
        self.lib, self.ctx = engine._lib, engine._ctx
        self.prompt_s, self.evaluated = 0.0, 0

    def prefill(self, tokens: list[int], pieces: list[int], bodies: list[tuple[int, int]]) -> int:
        """Place and evaluate the prompt but its last token, as the engine does; its slot."""
        engine, began = self.engine, time.perf_counter()
        sequence = LlamaSequence(tokens, 1, engine._greedy, cut_pieces(tokens, pieces), bodies)
        with engine._lock:
            placement = engine._place(sequence)
        engine._load(placement)
        last, block = len(tokens) - 1, engine.config.block
        while sequence.evaluated < last:
            start, stop = sequence.evaluated, sequence.stops[0] if sequence.stops else None
            if stop is not None and start == stop.at:
                assert engine._blender is not None
                self.evaluated += engine._blender.place(sequence.slot, tokens, stop)
                sequence.stops.popleft()
                sequence.evaluated = stop.end
                continue
            end = min(last, start - start % block + block, stop.at if stop else last)
            engine._evaluate_alone(tokens[start:end], start, sequence.slot)
            self.evaluated += end - start
            sequence.evaluated = end
        engine._documents.save(sequence.slot, sequence.pieces[: sequence.exact_pieces])
        with engine._lock:
            engine._documents.settle()
            engine._idle[sequence.slot] = []  # the slot's prefix is not offered again: each prompt places its own
        self.prompt_s += time.perf_counter() - began
        return sequence.slot

    def logits(self, tokens: Sequence[int], start: int, slot: int) -> np.ndarray:
        """Evaluate `tokens` from position `start`, the logits of every one (rows)."""
        batch, n_vocab = self.engine._batch.batch, self.lib.llama_vocab_n_tokens(self.engine.model.vocab)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = token, start + i, 1, slot, 1
        batch.n_tokens = len(tokens)
        status = self.lib.llama_decode(self.ctx.ctx, batch)
        batch.n_tokens = 0
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        return np.stack([np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx.ctx, i), (n_vocab,)).copy()
                         for i in range(len(tokens))])

    def ask(self, question: str, docs: list[Any], max_tokens: int, forced: list[int] | None) -> tuple[list[int], float]:
        """The greedy answer's tokens, and the mean NLL per token of `forced` (its own answer when None)."""
        llm = self.llm
        tokens, pieces = llm.prompt(llm.messages(question, docs), docs)
        slot = self.prefill(tokens, pieces, llm.bodies(tokens, pieces, docs))
        answer: list[int] = []
        position, token = len(tokens) - 1, tokens[-1]
        eog = self.engine.model.vocab
        while len(answer) < max_tokens:
            row = self.logits([token], position, slot)[0]
            token = int(row.argmax())
            if self.lib.llama_vocab_is_eog(eog, token):
                break
            answer.append(token)
            position += 1
        target = answer if forced is None else forced
        self.lib.llama_memory_seq_rm(self.ctx.memory, slot, len(tokens) - 1, -1)
        rows = self.logits([tokens[-1], *target[:-1]], len(tokens) - 1, slot) if target else np.zeros((0, 1))
        self.lib.llama_memory_seq_rm(self.ctx.memory, slot, -1, -1)
        if not target:
            return answer, 0.0
        shifted = rows - rows.max(axis=1, keepdims=True)
        logp = shifted[np.arange(len(target)), target] - np.log(np.exp(shifted).sum(axis=1))
        return answer, float(-logp.mean())

    def close(self) -> None:
        self.engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", default="0,0.15,0.3", help="recompute shares to measure")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--limit", type=int, default=0, help="questions from each set (0: all)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--plot", help="draw speed against the NLL ratio here (PNG)")
    parser.add_argument("--replay", help="a prefix_replay.py --json file: its blend gains are the plot's speed")
    args = parser.parse_args()
    questions = [q["question"] for name in SETS
                 for q in json.loads((ROOT / "benchmarks" / name).read_text())[: args.limit or None]]
    docs = pydoc_corpus()
    retrieve = PlainRetriever(docs, 3)
    retrieved = [retrieve(q) for q in questions]
    llm = LlamaCppGenerator(threads=1)
    llm.setup()
    assert llm.engine is not None
    llm.engine.close()
    results: dict[str, Any] = {}
    exact_answers: list[list[int]] = []
    for name, kv_reuse, ratio in [("exact", "exact", 0.0), *(
            (f"blend {float(r):g}", "blend", float(r)) for r in args.ratios.split(","))]:
        arm, answers, nll = Arm(llm, kv_reuse, ratio), [], []
        try:
            for i, (question, found) in enumerate(zip(questions, retrieved)):
                answer, loss = arm.ask(question, found, args.max_tokens, exact_answers[i] if exact_answers else None)
                answers.append(answer)
                nll.append(loss)
            stats = arm.engine.stats()
        finally:
            arm.close()
        if not exact_answers:
            exact_answers = answers
        texts = [llm.engine.model.detokenize(a).decode(errors="replace") for a in answers]
        reference = [llm.engine.model.detokenize(a).decode(errors="replace") for a in exact_answers]
        results[name] = {"identical": sum(a == b for a, b in zip(answers, exact_answers)),
                         "rouge_l": float(np.mean([rouge_l(a, b) for a, b in zip(texts, reference)])),
                         "nll": float(np.mean(nll)), "prompt_s": arm.prompt_s, "prompt_tokens_evaluated": arm.evaluated,
                         "documents_reused": stats.get("blend_documents_reused", 0),
                         "documents_evaluated_alone": stats.get("blend_documents_evaluated", 0), "answers": texts}
        print(name, {k: v for k, v in results[name].items() if k != "answers"}, flush=True)
    base = results["exact"]
    print(f"\n{len(questions)} questions, top-3 pydoc chunks each, answers of up to {args.max_tokens} tokens\n")
    print("| KV | answers identical to exact | ROUGE-L vs exact | NLL of the exact answer (ratio to exact KV) "
          "| prompt tokens evaluated | prompt seconds (speed-up) | documents placed: reused / evaluated alone |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, found in results.items():
        print(f"| {name} | {found['identical']}/{len(questions)} | {found['rouge_l']:.3f} | {found['nll']:.3f} "
              f"({found['nll'] / base['nll']:.2f}x) | {found['prompt_tokens_evaluated']:,} | {found['prompt_s']:.1f} "
              f"({base['prompt_s'] / found['prompt_s']:.2f}x) | {found['documents_reused']} / "
              f"{found['documents_evaluated_alone']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "questions": questions, "results": results}, indent=1))
    if args.plot:
        plot(results, args.plot, json.loads(Path(args.replay).read_text()) if args.replay else None)


def plot(results: dict[str, Any], path: str, replay: dict[str, Any] | None) -> None:
    """Speed against the exact answer's NLL ratio, one point per arm: the replayed stream's time over the
    exact document cache's when `replay` (a prefix_replay.py result) is given, else this run's prompt
    seconds over exact's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results["exact"]
    gains = replay["rows"][0]["blend_gain_over_document_cache"] if replay else {}
    figure, axes = plt.subplots(figsize=(5, 3.5))
    for name, found in results.items():
        ratio = "exact" if name == "exact" else str(float(name.split()[1]))
        if replay and ratio != "exact" and ratio not in gains:
            continue
        x = found["nll"] / base["nll"]
        y = (1.0 if ratio == "exact" else gains[ratio]) if replay else base["prompt_s"] / found["prompt_s"]
        axes.scatter([x], [y])
        axes.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4))
    axes.set_xlabel("NLL of the exact answer, ratio to exact KV")
    axes.set_ylabel("replayed stream, over the exact cache" if replay else "prompt evaluation speed-up over exact")
    axes.axvline(1.1, linestyle=":", color="grey")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
