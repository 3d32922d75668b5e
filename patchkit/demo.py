"""`patchkit demo`, and the runner every example's main block shares: deploy a pipeline on worker
processes, ask it questions concurrently, print each answer with its sources, then a table of what
each component did."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TextIO

from patchkit.client.deploy import deploy
from patchkit.client.endpoint import Endpoint
from patchkit.program.pipeline import Pipeline
from patchkit.tables import text_table

__all__ = ["ask", "component_table", "main"]


def ask(
    pipeline: Pipeline,
    questions: Sequence[str],
    *,
    input_name: str = "question",
    out: TextIO = sys.stdout,
    **options: Any,
) -> list[Any]:
    """Deploy `pipeline` (`options` go to `deploy`), ask every question at once, print and return the outputs."""
    started = time.perf_counter()
    print(f"Starting {len(pipeline.components)} components on worker processes...", file=out, flush=True)
    with deploy(pipeline, **options) as endpoint:
        print(f"Deployed at {endpoint.url} in {time.perf_counter() - started:.1f} s.\n", file=out, flush=True)
        outputs = _ask_all(endpoint, questions, input_name)
        for question, output in zip(questions, outputs):
            print(_describe(question, output), file=out)
        print(component_table(endpoint.stats()), file=out, flush=True)
    return outputs


def _ask_all(endpoint: Endpoint, questions: Sequence[str], input_name: str) -> list[Any]:
    # Concurrent requests meet in the components' queues: the table shows the batches they formed.
    with ThreadPoolExecutor(max_workers=len(questions) or 1) as pool:
        return list(pool.map(lambda q: endpoint.query(**{input_name: q}), questions))


def _describe(question: str, output: Any) -> str:
    if not isinstance(output, dict) or "answer" not in output:
        return f"Q: {question}\nA: {output}\n"
    lines = [f"Q: {question}", f"A: {output['answer']}"]
    for key, value in output.items():
        if key != "answer":
            shown = ", ".join(map(str, value)) if isinstance(value, list) else str(value)
            lines.append(f"   {key}: {' '.join(shown.split())}")
    return "\n".join(lines) + "\n"


def component_table(stats: Mapping[str, Any]) -> str:
    """Per component method: replicas, batch size, calls, batches, mean batch, mean batch latency and
    the prompt tokens its replicas reused of those they were given.

    The mean batch of a method whose engine batches by itself (its component reports `decode_steps`
    and `decoded_sequences`, as `LlamaCppGenerator` does) is the engine's: sequences per decode step."""
    engines = _engine_figures(stats.get("replica_reports", {}))
    rows = []
    for name, component in stats["components"].items():
        for method, m in component["methods"].items():
            figures = engines.get(name, {})
            batch = figures["decoded_sequences"] / figures["decode_steps"] if figures.get("decode_steps") else m["mean_batch"]
            prompt = figures.get("prompt_tokens_reused", 0) + figures.get("prompt_tokens_evaluated", 0)
            reused = f"{figures['prompt_tokens_reused']:.0f}/{prompt:.0f}" if prompt else "-"
            rows.append((
                f"{name}.{method}", str(len(component["replicas"])), str(m["batch_size"]), str(m["calls"]),
                str(m["batches"]), f"{batch:.2f}", f"{m['mean_batch_ms']:.0f}", reused,
            ))
    header = ("component", "replicas", "batch size", "calls", "batches", "mean batch", "mean latency ms", "prompt reused")
    return text_table(header, rows)


def _engine_figures(reports: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per component, its replicas' engine counters summed (those that report them)."""
    keys = ("decode_steps", "decoded_sequences", "prompt_tokens_reused", "prompt_tokens_evaluated")
    figures: dict[str, dict[str, float]] = {}
    for report in reports.values():
        own = report.get("component_stats") or {}
        if isinstance(own, dict) and "component" in report and any(key in own for key in keys):
            summed = figures.setdefault(report["component"], dict.fromkeys(keys, 0.0))
            for key in keys:
                summed[key] += float(own.get(key, 0))
    return figures


def main(questions: Sequence[str] | None = None, *, replicas: int | None = None) -> int:
    """The CRAG example on the pydoc corpus, SmolLM2 and real workers."""
    try:
        from patchkit.examples import crag  # builds the components: cheap, but they find their model files
    except (ImportError, FileNotFoundError) as exc:
        print(f"patchkit demo: {exc}", file=sys.stderr)
        return 2
    print(
        "patchkit demo: the CRAG pipeline (retrieve, grade, rewrite and search on failure, generate) over the\n"
        "Python documentation, with SmolLM2-135M-Instruct. The index is built on first use (about a minute), then cached.\n",
        flush=True,
    )
    ask(crag.pipeline, questions or crag.QUESTIONS, replicas=replicas)
    return 0
