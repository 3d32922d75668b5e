"""The command line of `patchkit bench URL` (and `python -m patchkit.bench URL`): its options, its
inputs from `--inputs` or `--inputs-file`, and a run that prints the table and writes `--json` and
`--plot`.

`patchkit.cli` adds `add_arguments` to its `bench` subcommand and calls `run_from_args`;
`python -m patchkit.bench` and the scripts in `benchmarks/` go through `main`.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from patchkit.bench.load import run_bench, run_closed
from patchkit.bench.plot import BENCH_EXTRA, pyplot
from patchkit.errors import PatchkitError


def _read_inputs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """--inputs JSON, or --inputs-file JSON lines: each an object; errors name the line."""
    if args.inputs_file is not None:
        path = Path(args.inputs_file)
        try:
            lines = path.read_text().splitlines()
        except OSError as exc:
            raise PatchkitError(f"cannot read --inputs-file {path}: {exc.strerror}") from None
        found = []
        for number, line in enumerate(lines, 1):
            if line.strip():
                found.append(_parse_inputs(line, f"{path}:{number}"))
        if not found:
            raise PatchkitError(f"--inputs-file {path} has no inputs: write one JSON object per line")
        return found
    return [_parse_inputs(args.inputs, "--inputs")]


def _parse_inputs(text: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PatchkitError(f"{where} is not valid JSON ({exc}): {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise PatchkitError(f'{where} must be a JSON object such as {{"query": "..."}}; got {text[:80]!r}')
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `patchkit bench`; `patchkit.cli` adds them to its `bench` subcommand."""
    parser.add_argument("url", help="the endpoint, as http://HOST:PORT")
    load = parser.add_mutually_exclusive_group(required=True)
    load.add_argument("--rate", type=float, help="Poisson arrivals per second")
    load.add_argument("--schedule", help="rates over time as seconds:rate steps, such as 0:50,10:100,20:50")
    load.add_argument(
        "--concurrency", metavar="N", type=int, help="a closed loop instead: N clients, each sending when its last is answered"
    )
    parser.add_argument("--seconds", type=float, required=True, help="how long to send requests")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--inputs", help='the inputs of every request, as JSON: \'{"query": "..."}\'')
    given.add_argument("--inputs-file", help="a JSON-lines file of inputs objects, which the requests take in turn")
    parser.add_argument("--slo-ms", type=float, help="the latency target: sent with each request, reported as attainment")
    parser.add_argument(
        "--concurrency-limit", metavar="N", type=int, default=4096, help="outstanding requests past which arrivals are dropped"
    )
    parser.add_argument("--timeout-s", type=float, default=30.0, help="a request unanswered by then is an error")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the arrival times")
    parser.add_argument("--stream", action="store_true",
                        help="stream each answer (server-sent events) and report time to first token beside latency")
    parser.add_argument("--json", metavar="FILE", help="write the summary, series and every request as JSON")
    parser.add_argument("--plot", metavar="FILE", help=f"write a PNG of latency, rates and replicas ({BENCH_EXTRA})")


def run_from_args(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    """`patchkit bench` after parsing: run, print the table, write --json and --plot."""
    inputs = _read_inputs(args)
    if args.plot is not None:
        pyplot()  # missing matplotlib should stop the run before it, not after
    if args.concurrency is not None:
        result = run_closed(
            args.url, concurrency=args.concurrency, seconds=args.seconds, inputs=inputs, slo_ms=args.slo_ms,
            timeout_s=args.timeout_s, stream=args.stream,
        )
    else:
        result = run_bench(
            args.url, rate=args.rate, schedule=args.schedule, seconds=args.seconds, inputs=inputs, slo_ms=args.slo_ms,
            concurrency_limit=args.concurrency_limit, timeout_s=args.timeout_s, seed=args.seed, stream=args.stream,
        )
    out(result.table())
    if args.json is not None:
        result.write_json(args.json)
        out(f"wrote {args.json}")
    if args.plot is not None:
        result.plot(args.plot)
        out(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m patchkit.bench URL ...`, the same as `patchkit bench URL ...`."""
    parser = argparse.ArgumentParser(
        prog="patchkit bench", description="Open-loop Poisson load (or a closed loop of clients) against a patchkit endpoint."
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except PatchkitError as exc:
        print(f"patchkit bench: {exc}", file=sys.stderr)
        return 2
