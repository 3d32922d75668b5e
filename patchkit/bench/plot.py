"""The PNG of a benchmark run, in the style of Patchwork's Figure 15: latency, offered and achieved
rate, and replicas per component over the run's time.

`BenchResult.plot` calls `draw`; `patchkit bench --plot` calls `pyplot` first, so that a missing
matplotlib (the `bench` extra) stops the run before it starts. matplotlib is imported only then.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchkit.errors import PatchkitError

if TYPE_CHECKING:
    from patchkit.bench.report import BenchResult

BENCH_EXTRA = "pip install -e '.[bench]' in patchkit's checkout"


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), or an error naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise PatchkitError(f"--plot needs matplotlib, which is not installed: {BENCH_EXTRA}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def draw(result: BenchResult, path: str | Path) -> None:
    """Three panels sharing the time axis: p50 and p99 per second with the SLO line; the schedule's
    rate (an open loop's), requests sent and answered per second; replicas per component."""
    plt = pyplot()
    from matplotlib.ticker import MaxNLocator

    series = result.series()
    t = [x + 0.5 for x in series["t_s"]]  # a second's values at its middle
    figure, (latency, rate, replicas) = plt.subplots(3, 1, sharex=True, figsize=(8, 8), constrained_layout=True)
    latency.plot(t, [float("nan") if v is None else v for v in series["p50_ms"]], marker=".", label="p50")
    latency.plot(t, [float("nan") if v is None else v for v in series["p99_ms"]], marker=".", label="p99")
    if result.slo_ms is not None:
        latency.axhline(result.slo_ms, color="red", linestyle="--", label=f"SLO {result.slo_ms:g} ms")
    latency.set_ylabel("latency (ms)")
    latency.set_ylim(bottom=0)
    latency.set_title(f"{result.url}: {result.describe()}")
    latency.legend(loc="best")
    steps_rate: list[float] = []
    if result.schedule is not None:
        steps_t = [start for start, _ in result.schedule.steps] + [result.seconds]
        steps_rate = [rate for _, rate in result.schedule.steps]
        rate.stairs(steps_rate, steps_t, baseline=None, color="gray", linestyle="--", label="offered (schedule)")
    rate.plot(t, series["sent"], marker=".", label="sent")
    rate.plot(t, series["completed_ok"], marker=".", label="achieved (ok)")
    rate.set_ylabel("requests/s")
    top = max([*steps_rate, *series["sent"], *series["completed_ok"]]) or 1  # a closed loop that sent nothing
    rate.set_ylim(0, 1.4 * top)  # room for the legend
    rate.legend(loc="upper left", ncol=3)
    most = 1
    for name, points in sorted(result.replica_series().items()):
        times, counts = [p[0] for p in points], [p[1] for p in points]
        replicas.step([*times, result.seconds], [*counts, counts[-1]], where="post", label=name)
        most = max(most, *counts)
    replicas.set_ylabel("replicas")
    replicas.set_xlabel("time (s)")
    replicas.set_xlim(0, result.seconds)
    replicas.set_ylim(0, most + 1)
    replicas.yaxis.set_major_locator(MaxNLocator(integer=True))
    if result.replicas:
        replicas.legend(loc="upper left")
    figure.savefig(str(path), dpi=120)
    plt.close(figure)
