"""What the guards cost local work while read-only calls are in flight: a membership loop, on and off.

    python benchmarks/overlap_guards.py [--size 2000] [--repeats 15] [--json out.json]

A pipeline captured inside a function makes two read-only calls, then runs the loop
`for x in range(size): if x in big: hits += 1` over a list of `size` numbers before it uses their results.
It runs two ways, alternating, each `--repeats` times: as plain Python (`pipeline(...)`, the calls made
where they are) and as the parallel program deployments run, with both calls open through the whole loop
(each call is run only when the code waits for it, as `tests/test_parallel_rewrite.py` does, so no thread
or process adds its own time). Reported: the fastest time of each (the least disturbed on a shared
machine), their ratio and the ratio of the medians, and whether the calls did stay open through the loop.
Results: benchmarks/README.md, "The guards' cost per instruction".
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import patchkit
from patchkit import Component, make
from patchkit.capture.pending import Window, run_in_window
from patchkit.core import call_hook


class Stage(Component):
    """A read-only call that answers at once: the loop's time is all that is measured."""

    @make(read_only=True)
    def run(self, text: str) -> str:
        return text.upper()


stage = Stage()


def membership(size: int) -> patchkit.Pipeline:
    with patchkit.capture(run=False) as pipeline:
        first = stage.run("first")
        second = stage.run("second")
        big = list(range(size))
        hits = 0
        for x in range(size):
            if x in big:
                hits += 1
        return [first, second, hits]
    return pipeline


def run_open(pipeline: patchkit.Pipeline, inputs: dict[str, Any]) -> tuple[Any, int]:
    """The parallel program, each deferred call run only when the code waits for it; also how many calls
    were still open when the first wait came (2: the loop ran with both in flight)."""
    window = Window()
    open_at_first_wait: list[int] = []

    def hook(component: Any, method: Any, args: tuple[Any, ...], kwargs: dict[str, Any], site: Any) -> Any:
        def wait() -> Any:
            if not open_at_first_wait:
                open_at_first_wait.append(len(window))
            return method.run_local(component, args, kwargs)

        return window.add(wait, lambda: None) if site is not None and site.deferred else wait()

    with call_hook(hook):
        output = run_in_window(window, lambda: pipeline.run(pipeline.variables(inputs), parallel=True))
    return output, open_at_first_wait[0] if open_at_first_wait else 0


def measure(size: int, repeats: int) -> dict[str, Any]:
    pipeline = membership(size)
    inputs = {"size": size}
    plain_s, open_s, still_open = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        expected = pipeline(**inputs)
        plain_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        got, still = run_open(pipeline, inputs)
        open_s.append(time.perf_counter() - start)
        still_open.append(still)
        if got != expected:
            raise SystemExit(f"outputs differ: {got!r} != {expected!r}")
    plain, overlapped = min(plain_s), min(open_s)  # the least disturbed run of each, on a shared machine
    return {"size": size, "repeats": repeats, "plain_ms": plain * 1e3, "calls_open_ms": overlapped * 1e3,
            "ratio": overlapped / plain, "median_ratio": statistics.median(open_s) / statistics.median(plain_s),
            "calls_open_through_loop": min(still_open)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    result = measure(args.size, args.repeats)
    print(f"{args.size}x{args.size} membership loop: plain Python {result['plain_ms']:.1f} ms, "
          f"read-only calls open {result['calls_open_ms']:.1f} ms (fastest of {args.repeats}), ratio "
          f"{result['ratio']:.2f}x (of the medians {result['median_ratio']:.2f}x), "
          f"{result['calls_open_through_loop']} calls still open when the loop ended")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
