"""GuideLLM against patchkit's OpenAI chat route and against llama-cpp-python's OpenAI server, on one GGUF.

    python benchmarks/guidellm_chat.py --guidellm /path/to/venv/bin/guidellm --tokenizer DIR --json raw.json
    python benchmarks/guidellm_chat.py --json raw.json --result benchmarks/results/guidellm_chat.json

GuideLLM (the vLLM project's load generator, in an environment of its own: `pip install guidellm==0.8.1`)
sends synthetic prompts of `--prompt-tokens` tokens asking for `--output-tokens` each (`max_completion_tokens`,
`ignore_eos: true`, `stop: null`, streamed with `stream_options.include_usage`), `--requests` of them at each
concurrency of `--concurrency`, counting tokens with SmolLM2's tokenizer (`--tokenizer`: a folder that
`transformers` wrote from the GGUF, `AutoTokenizer.from_pretrained(dir, gguf_file=...)` then
`save_pretrained`). Two servers, each a fresh process, on the bundled SmolLM2-135M-Instruct and the same cores:

- `patchkit`: `patchkit serve` of a one-LLM chat pipeline written as the docs write one
  (`LlamaCppGenerator()` answering the question), deployed with its defaults;
- `llama-cpp`: `python -m llama_cpp.server --model GGUF --n_threads CORES --interrupt_requests False` (through
  patchkit's loader, which turns off the weight repacking that crashes llama.cpp on AMX hosts), the server a user
  picks to serve one GGUF over OpenAI's API; it answers one request at a time, the others waiting. It has no
  `GET /health`, on which GuideLLM's default backend check aborts the run: its arm runs with
  `validate_backend=false`.

Each arm's figures per concurrency (requests/s, output tokens/s, TTFT and ITL percentiles, output tokens per
request as GuideLLM counted them, errors) accumulate in `--json`; `--result` writes the result file with the
ratios of patchkit to llama-cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import provenance  # noqa: E402

ARMS = ("patchkit", "llama-cpp")
READY_TIMEOUT_S = 300.0
APP = '''
import patchkit
from patchkit.components import LlamaCppGenerator

llm = LlamaCppGenerator()
question = "What is a generator?"
with patchkit.capture(run=False) as pipeline:
    answer = llm.generate(question)
'''


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(arm: str, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    """The arm's server, a fresh process listening on 127.0.0.1:`port`; its log in `workdir`."""
    from patchkit.components.generators.base import default_gguf_path

    if arm == "patchkit":
        app = workdir / "chat_app.py"
        app.write_text(APP)
        command = [sys.executable, "-m", "patchkit.cli", "serve", str(app), "--port", str(port)]
    else:
        command = [sys.executable, "-m", "patchkit.components.generators.llama.loading", "llama_cpp.server",
                   "--model", str(default_gguf_path()), "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
                   "--n_threads", str(os.cpu_count() or 1), "--interrupt_requests", "False"]
    log = (workdir / f"{arm}.log").open("wb")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def wait_ready(url: str, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode} before answering")
        try:
            with httpx.Client(timeout=5) as client:
                if client.get(url + "/v1/models").status_code == 200:
                    return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not answer /v1/models within {READY_TIMEOUT_S:g} s")


def guidellm(binary: str, url: str, tokenizer: str, streams: int, args: argparse.Namespace, out: Path,
             validate: bool) -> dict[str, Any]:
    """One GuideLLM run at `streams` concurrent requests; its JSON report's benchmark. `validate`: GuideLLM's
    backend check first (`GET /health`, vLLM's probe)."""
    backend = f"kind=openai_http,target={url}" + ("" if validate else ",validate_backend=false")
    command = [binary, "run", "--backend", backend,
               "--profile", f"kind=concurrent,streams={streams}",
               "--constraint", f"kind=max_requests,count={args.requests}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
               "--output", f"kind=json,path={out}", "--disable-console-interactive"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    if done.returncode != 0:
        raise RuntimeError(f"guidellm exited with {done.returncode}: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    report = json.loads(out.read_text())
    return summary(report["benchmarks"][0], args.output_tokens)


def summary(benchmark: dict[str, Any], asked: int) -> dict[str, Any]:
    """What a benchmark of GuideLLM's report says, in this file's terms."""
    metrics = benchmark["metrics"]

    def stat(name: str, kind: str = "successful") -> dict[str, Any]:
        return dict(metrics[name][kind])

    def pct(name: str, which: str) -> float:
        return float(stat(name)["percentiles"][which])

    totals = benchmark.get("scheduler_metrics", {}).get("requests_made", {})
    requests = benchmark.get("requests", {}).get("successful", [])
    made = [int(r.get("output_metrics", {}).get("text_tokens") or r.get("output_tokens") or 0) for r in requests]
    return {
        "requests_per_s": stat("requests_per_second")["mean"],
        "output_tokens_per_s": stat("output_tokens_per_second")["mean"],
        "ttft_ms": {"p50": pct("time_to_first_token_ms", "p50"), "p99": pct("time_to_first_token_ms", "p99")},
        "itl_ms": {"p50": pct("inter_token_latency_ms", "p50"), "p99": pct("inter_token_latency_ms", "p99")},
        "output_tokens_per_request": stat("output_token_count")["mean"],
        "requests_with_asked_tokens": sum(1 for n in made if n == asked),
        "successful": totals.get("successful", len(requests)), "errored": totals.get("errored", 0),
        "incomplete": totals.get("incomplete", 0),
    }


def run_arm(arm: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"guidellm-{arm}-") as tmp:
        workdir = Path(tmp)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        load = os.getloadavg()[0]
        server = start(arm, port, workdir)
        try:
            wait_ready(url, server)
            levels = {}
            for streams in args.concurrency:
                levels[str(streams)] = guidellm(args.guidellm, url, args.tokenizer, streams, args,
                                                workdir / f"c{streams}.json", validate=arm != "llama-cpp")
                print(arm, streams, json.dumps(levels[str(streams)]), flush=True)
            return {"levels": levels, "load_before": load, "load_after": os.getloadavg()[0],
                    "server_errors": server_errors((workdir / f"{arm}.log").read_text(errors="replace"))}
        except Exception as exc:
            log = (workdir / f"{arm}.log").read_text(errors="replace")[-3000:]
            return {"failed": f"{type(exc).__name__}: {exc}", "log_tail": log, "load_before": load}
        finally:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()


def server_errors(log: str) -> dict[str, int]:
    """The exceptions a server's log ends tracebacks with, each with how often: how a server failed requests."""
    counts: dict[str, int] = {}
    lines = log.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback") or not i or not lines[i - 1].startswith("  "):
            continue
        if line and not line.startswith(" ") and ("Error" in line.split(":")[0] or "Exception" in line.split(":")[0]):
            counts[line[:200]] = counts.get(line[:200], 0) + 1
    return counts


def result(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The result file: each arm's figures per concurrency, and patchkit's ratios to llama-cpp's where both answered."""
    levels = [str(c) for c in args.concurrency]
    tables = [arm_table(arm, raw.get(arm, {}), levels) for arm in ARMS if raw.get(arm)]
    ratios = []
    for level in levels:
        ours, theirs = (raw.get(arm, {}).get("levels", {}).get(level) for arm in ARMS)
        if ours and theirs and ours["successful"] and theirs["successful"]:
            ratios.append([level, f"{ours['requests_per_s'] / theirs['requests_per_s']:.2f}x",
                           f"{ours['output_tokens_per_s'] / theirs['output_tokens_per_s']:.2f}x",
                           f"{ours['ttft_ms']['p50'] / theirs['ttft_ms']['p50']:.2f}x"])
    if ratios:
        tables.append({"caption": "patchkit / llama-cpp", "columns": ["concurrency", "requests/s", "output tokens/s",
                                                                      "TTFT p50"], "rows": ratios})
    plot = {"title": "output tokens/s by concurrency", "kind": "bar", "x": levels,
            "series": {arm: [raw.get(arm, {}).get("levels", {}).get(c, {}).get("output_tokens_per_s", 0.0) for c in levels]
                       for arm in ARMS}}
    load = min((arm.get("load_before", 0.0) for arm in raw.values()), default=0.0)
    return provenance.result_file(
        title="GuideLLM against patchkit's chat route and llama-cpp-python's server", components="real models",
        load_before=load, setup=f"SmolLM2-135M-Instruct Q4_1 (the bundled GGUF) through llama.cpp on both sides; "
        f"{args.prompt_tokens}-token synthetic prompts asking {args.output_tokens} tokens (ignore_eos), {args.requests} "
        "requests per concurrency, each server a fresh process", tables=tables, plots=[plot], arms=raw)


def arm_table(arm: str, figures: dict[str, Any], levels: list[str]) -> dict[str, Any]:
    """One arm's figures as GuideLLM measured them, a row per concurrency; how its server failed, if it did."""
    rows = []
    for level in levels:
        got = figures.get("levels", {}).get(level)
        if got is None:
            continue
        answered = got["successful"]
        rows.append([level, f"{got['requests_per_s']:.3f}", f"{got['output_tokens_per_s']:.1f}",
                     f"{got['ttft_ms']['p50']:.0f} / {got['ttft_ms']['p99']:.0f}",
                     f"{got['itl_ms']['p50']:.1f} / {got['itl_ms']['p99']:.1f}",
                     f"{got['output_tokens_per_request']:.1f}", f"{got['requests_with_asked_tokens']} of {answered}",
                     str(got["errored"])])
    errors = "; ".join(figures.get("server_errors", {}))
    caption = arm + (f" (its log: {errors})" if errors else "") + (f" failed: {figures['failed']}" if "failed" in figures
                                                                   else "")
    return {"caption": caption, "columns": ["concurrency", "requests/s", "output tokens/s", "TTFT p50 / p99 ms",
                                            "ITL p50 / p99 ms", "output tokens per request", "with the tokens asked",
                                            "errored"], "rows": rows}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guidellm", help="the guidellm command, from its own environment")
    parser.add_argument("--tokenizer", help="SmolLM2's tokenizer folder (see above)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--concurrency", default="1,4,8", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--json", type=Path, required=True, help="raw figures, accumulated across invocations")
    parser.add_argument("--result", type=Path, help="write the result file from --json")
    args = parser.parse_args(argv)
    raw: dict[str, Any] = json.loads(args.json.read_text()) if args.json.exists() else {}
    if args.result is not None:
        provenance.write(args.result, result(raw, args))
        return
    if not args.guidellm or not args.tokenizer:
        parser.error("--guidellm and --tokenizer are needed to run the arms")
    for arm in args.arms.split(","):
        raw[arm] = run_arm(arm, args)
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
