"""One GGUF served three ways under GuideLLM: llama.cpp's `llama-server`, llama-cpp-python's server, patchkit.

    python benchmarks/llm_serving.py build                        # llama-server, in benchmarks/build/
    python benchmarks/llm_serving.py run --guidellm /path/to/venv/bin/guidellm --json raw.json
    python benchmarks/llm_serving.py run ... --levels 1,8 --seconds 30 --sides patchkit,llama-server
    python benchmarks/llm_serving.py result raw.json --machine "2 cores, shared" --result benchmarks/results/llm_serving.json

The bundled SmolLM2-135M (Q4_1) on every core this process may use, three servers:

- `llama-server`: llama.cpp's own, built (`build`) from the llama.cpp source vendored in the sdist
  of the installed llama-cpp-python's version (`pip download --no-binary :all:`, cmake, in
  `benchmarks/build/`, never at install), `--parallel 8`, a thread per core: continuous batching
  with prompt chunks and decode tokens in one batch;
- `llama_cpp.server`: llama-cpp-python's OpenAI server, `--n_threads` a thread per core, one request
  at a time (`--interrupt_requests False`: by default a new request cuts the one streaming short,
  which GuideLLM counts as an empty answer); GuideLLM sends a message's content as a list of text parts, which its chat template
  cannot join, so this process runs it with each message's parts joined into a plain string first
  (`serve-llama-cpp-python`: the string a client sending plain strings sends);
- `patchkit`: a one-LLM chat pipeline (`LlamaCppGenerator(max_tokens=64)`) deployed with no plan, so
  with the machine's defaults (`patchkit/config/machine.py`), behind its OpenAI chat route.

GuideLLM (its own virtualenv, `--guidellm`) sends synthetic prompts of `--prompt-tokens` tokens
asking `--output-tokens`, counted by SmolLM2's tokenizer (read from the GGUF by transformers into
`benchmarks/build/smollm2-tokenizer`), from `--streams`-wide closed loops for `--seconds` each. Each
level gets a new prompt set (GuideLLM's seed is the level), the same for every side at that level;
each side runs in a fresh process for each level, and the order of the sides turns at each level
so that none always runs first or last on a machine others share. The raw file holds GuideLLM's
numbers per side and level (requests/s, output tokens/s, TTFT and ITL p50/p99) and the 1-minute load
average around each run; patchkit's engine counters (`/metrics`) are kept beside its runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "benchmarks" / "build"
SIDES = ("llama-server", "llama_cpp.server", "patchkit")
READY_S = 180.0
READY = {"llama-server": "/health", "llama_cpp.server": "/v1/models", "patchkit": "/readyz"}  # 200 once it serves


def gguf() -> Path:
    from patchkit.components.generators.base import default_gguf_path

    return Path(default_gguf_path())


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def build(folder: Path) -> Path:
    """`llama-server` built from the llama.cpp source in the installed llama-cpp-python's sdist; its path."""
    import llama_cpp

    version = llama_cpp.__version__
    source = folder / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    binary = source / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    folder.mkdir(parents=True, exist_ok=True)
    sdist = folder / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={version}", "-d", str(folder)], check=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(folder, filter="data")
    subprocess.run(["cmake", "-B", "build", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                    "-DLLAMA_BUILD_TESTS=OFF"], cwd=source, check=True)
    subprocess.run(["cmake", "--build", "build", "--target", "llama-server", "-j", str(cores())], cwd=source, check=True)
    return binary


def tokenizer(guidellm: Path, folder: Path) -> Path:
    """SmolLM2's tokenizer as a folder GuideLLM loads, read from the GGUF by transformers (in GuideLLM's venv)."""
    target = folder / "smollm2-tokenizer"
    if not (target / "tokenizer.json").exists():
        model = gguf()
        script = ("import sys\nfrom transformers import AutoTokenizer\n"
                  "AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2]).save_pretrained(sys.argv[3])\n")
        subprocess.run([str(guidellm.parent / "python"), "-c", script, str(model.parent), model.name, str(target)], check=True)
    return target


def serve_patchkit(port: int) -> None:
    """This process as patchkit's server: a one-LLM chat pipeline, deployed with no plan, until SIGTERM."""
    import patchkit
    from patchkit.components import LlamaCppGenerator

    llm = LlamaCppGenerator(max_tokens=64)
    question = "What is a tuple?"
    with patchkit.capture(run=False, output="answer") as pipeline:
        answer = llm.generate(question)  # noqa: F841 - the block's output
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with patchkit.deploy(pipeline, port=port) as endpoint:
        print(f"READY {endpoint.url}", flush=True)
        stop.wait()


def serve_llama_cpp_python(argv: list[str]) -> None:
    """llama-cpp-python's server (`python -m llama_cpp.server`, these arguments), given messages whose
    content is a list of text parts as plain strings."""
    import llama_cpp
    from llama_cpp.server.__main__ import main as server_main

    chat = llama_cpp.Llama.create_chat_completion

    def plain(self: Any, messages: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
        flat = [{**m, "content": "".join(part.get("text", "") for part in m["content"])}
                if isinstance(m.get("content"), list) else m for m in messages]
        return chat(self, flat, *args, **kwargs)

    llama_cpp.Llama.create_chat_completion = plain  # type: ignore[method-assign]
    sys.argv = ["llama_cpp.server", *argv]
    server_main()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def command(side: str, port: int, server: Path) -> list[str]:
    threads = str(cores())
    if side == "llama-server":
        return [str(server), "-m", str(gguf()), "--host", "127.0.0.1", "--port", str(port), "--parallel", "8",
                "-t", threads, "-tb", threads, "-c", str(8 * 2048), "--no-webui"]
    if side == "llama_cpp.server":
        return [sys.executable, str(Path(__file__).resolve()), "serve-llama-cpp-python", "--model", str(gguf()),
                "--host", "127.0.0.1", "--port", str(port),
                "--n_threads", threads, "--n_threads_batch", threads, "--n_ctx", "2048", "--interrupt_requests", "False"]
    return [sys.executable, str(Path(__file__).resolve()), "serve-patchkit", "--port", str(port)]


@contextlib.contextmanager
def started(side: str, server: Path, log: Path) -> Iterator[str]:
    """The side's server as a fresh process, until the block ends; yields the model name it serves."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    with log.open("a") as out:
        process = subprocess.Popen(command(side, port, server), stdout=out, stderr=subprocess.STDOUT, env=env,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + READY_S
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{READY[side]}", timeout=5):
                    pass
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{side} did not start: see {log}") from None
                time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
            model = json.load(response)["data"][0]["id"]
        yield f"http://127.0.0.1:{port}", model
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def scenario(target: str, model: str, tokens: Path, level: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    return {
        "spec": {
            # no health check: GuideLLM asks /health, which neither Python server serves (/v1/models answered)
            # max_tokens beside GuideLLM's max_completion_tokens, which llama-cpp-python's server does not read
            "backend": {"kind": "openai_http", "target": target, "model": model, "request_format": "/v1/chat/completions",
                        "validate_backend": False, "extras": {"body": {"max_tokens": args.output_tokens}}},
            "profile": {"kind": "concurrent"},
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokens)},
            "data": [{"kind": "synthetic_text", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens}],
            "seed": {"kind": "static", "value": level},
            "constraints": [{"kind": "max_duration", "seconds": args.seconds}],
            "outputs": [{"kind": "json", "path": str(out)}],
        },
        "benchmarks": [{"profile.streams": level}],
    }


def guidellm(args: argparse.Namespace, spec: Path, log: Path) -> None:
    """GuideLLM's run of `spec`, its processes ended with it whatever happens (they fork workers)."""
    with log.open("a") as out:
        process = subprocess.Popen([str(args.guidellm), "run", "-c", str(spec), "--disable-progress"], stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        if process.wait(timeout=args.seconds * 4 + 300) != 0:
            raise RuntimeError(f"GuideLLM failed: see {log}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def engine_counters(target: str) -> dict[str, float]:
    """patchkit's component counters from /metrics (the llama engine's among them), for where its time went."""
    with urllib.request.urlopen(f"{target}/metrics", timeout=10) as response:  # noqa: S310 - our own http:// server
        text = response.read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("patchkit_component_stat{"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            counters[name] = float(value)
    return counters


def run_level(side: str, level: int, args: argparse.Namespace, server: Path, tokens: Path, work: Path) -> dict[str, Any]:
    out = work / f"{side}-{level}.json"
    spec = work / f"{side}-{level}.scenario.json"
    log = work / f"{side}-{level}.log"
    load = [os.getloadavg()[0]]
    with started(side, server, log) as (target, model):
        spec.write_text(json.dumps(scenario(target, model, tokens, level, args, out)))
        guidellm(args, spec, log)
        counters = engine_counters(target) if side == "patchkit" else {}
    load.append(os.getloadavg()[0])
    return {"side": side, "streams": level, "metrics": summary(json.loads(out.read_text())), "load_1m": load,
            "engine": counters}


def summary(report: dict[str, Any]) -> dict[str, float]:
    """requests/s, output tokens/s and TTFT/ITL p50/p99 (ms) of GuideLLM's one benchmark in `report`."""
    metrics = report["benchmarks"][0]["metrics"]

    def successful(name: str) -> dict[str, Any]:
        return metrics[name]["successful"]

    out = {"requests_per_s": successful("requests_per_second")["mean"],
           "output_tokens_per_s": successful("output_tokens_per_second")["mean"],
           "requests": metrics["request_totals"]["successful"],
           "output_tokens_per_request": successful("output_token_count")["mean"]}
    for name, key in (("ttft", "time_to_first_token_ms"), ("itl", "inter_token_latency_ms")):
        percentiles = successful(key)["percentiles"]
        out[f"{name}_p50_ms"], out[f"{name}_p99_ms"] = percentiles["p50"], percentiles["p99"]
    return out


def run(args: argparse.Namespace) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that the servers and GuideLLM started end with it
    sides = args.sides.split(",")
    server = build(BUILD) if "llama-server" in sides else Path("llama-server")
    tokens = tokenizer(args.guidellm, BUILD)
    work = BUILD / "llm_serving"
    work.mkdir(parents=True, exist_ok=True)
    results = []
    for i, level in enumerate(int(n) for n in args.levels.split(",")):
        order = sides[i % len(sides):] + sides[: i % len(sides)]
        for side in order:
            result = run_level(side, level, args, server, tokens, work)
            print(json.dumps(result), flush=True)
            results.append(result)
            Path(args.json).write_text(json.dumps({"cores": cores(), "args": {k: str(v) for k, v in vars(args).items()},
                                                   "runs": results}, indent=1))


def result(raw: dict[str, Any], machine: str, commit: str) -> dict[str, Any]:
    """The site's result file from a raw file: per level, each side's numbers and its ratios to llama-server's."""
    runs = raw["runs"]
    by = {(r["side"], r["streams"]): r for r in runs}
    levels = sorted({r["streams"] for r in runs})
    sides = [side for side in SIDES if any(r["side"] == side for r in runs)]
    rows = []
    for level in levels:
        base = by.get(("llama-server", level), {}).get("metrics")
        for side in sides:
            run = by.get((side, level))
            if run is None:
                continue
            m = run["metrics"]
            ratio = f"{m['requests_per_s'] / base['requests_per_s']:.2f}x" if base and base["requests_per_s"] else "-"
            rows.append([str(level), side, str(m.get("requests", "-")), f"{m['requests_per_s']:.3f}", ratio,
                         f"{m['output_tokens_per_s']:.1f}",
                         f"{m['ttft_p50_ms']:,.0f} / {m['ttft_p99_ms']:,.0f}", f"{m['itl_p50_ms']:.0f} / {m['itl_p99_ms']:.0f}",
                         "-".join(f"{x:.1f}" for x in run["load_1m"])])
    args = raw["args"]
    return {
        "title": "One GGUF served by llama-server, llama-cpp-python's server and patchkit, under GuideLLM",
        "components": "real models", "machine": machine, "date": time.strftime("%Y-%m-%d"),
        "commit": commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                           text=True).stdout.strip(),
        "command": "python benchmarks/llm_serving.py run",
        "setup": (f"SmolLM2-135M Q4_1 on {raw['cores']} cores; GuideLLM 0.8.1 closed loops of N streams, "
                  f"{args['prompt_tokens']} prompt tokens asking {args['output_tokens']}, {args['seconds']} s a level, "
                  "a new prompt set per level, each server fresh, the sides' order turning per level. "
                  "llama-server --parallel 8 and llama_cpp.server at a thread per core; patchkit a one-LLM chat "
                  "pipeline deployed with no plan."),
        "tables": [{"caption": "Per level: requests answered in the window, requests/s (and its ratio to "
                               "llama-server's), output tokens/s, TTFT and ITL "
                               "p50 / p99 in ms, the 1-minute load average before and after the run.",
                    "columns": ["streams", "server", "answered", "req/s", "vs llama-server", "output tok/s", "TTFT p50 / p99",
                                "ITL p50 / p99", "load"], "rows": rows}],
        "plots": [{"title": "Requests per second by streams", "kind": "bar", "ylabel": "requests/s",
                   "x": [f"{level} streams" for level in levels],
                   "series": {side: [by[(side, level)]["metrics"]["requests_per_s"] if (side, level) in by else 0.0
                                     for level in levels] for side in sides}}],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("build", help="build llama-server in benchmarks/build/")
    serve = sub.add_parser("serve-patchkit", help="(internal) patchkit's server")
    serve.add_argument("--port", type=int, required=True)
    sub.add_parser("serve-llama-cpp-python", help="(internal) llama-cpp-python's server, its own arguments after",
                   add_help=False)
    bench = sub.add_parser("run", help="GuideLLM against each side, level by level")
    bench.add_argument("--guidellm", type=Path, required=True, help="the guidellm executable of its own virtualenv")
    bench.add_argument("--json", default="llm_serving-raw.json")
    bench.add_argument("--levels", default="1,2,4,8,16")
    bench.add_argument("--sides", default=",".join(SIDES))
    bench.add_argument("--seconds", type=int, default=30)
    bench.add_argument("--prompt-tokens", type=int, default=256)
    bench.add_argument("--output-tokens", type=int, default=64)
    if sys.argv[1:2] == ["serve-llama-cpp-python"]:
        serve_llama_cpp_python(sys.argv[2:])
        return
    written = sub.add_parser("result", help="the site's result file from raw files")
    written.add_argument("raw", help="a raw file of `run`, or several, comma-separated, their runs joined")
    written.add_argument("--machine", required=True, help="the machine the runs had, as the page names it")
    written.add_argument("--result", default="benchmarks/results/llm_serving.json")
    written.add_argument("--commit", default="", help="the commit the servers ran (default: HEAD)")
    args = parser.parse_args()
    if args.command == "result":
        raws = [json.loads(Path(p).read_text()) for p in args.raw.split(",")]
        joined = {**raws[0], "runs": [run for raw in raws for run in raw["runs"]]}
        Path(args.result).write_text(json.dumps(result(joined, args.machine, args.commit), indent=1) + "\n")
        return
    if args.command == "build":
        print(build(BUILD))
    elif args.command == "serve-patchkit":
        serve_patchkit(args.port)
    else:
        run(args)


if __name__ == "__main__":
    main()
