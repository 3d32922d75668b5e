"""What a benchmark run measured, and the reports made from it: one `RequestRecord` per request, the
`ReplicaSample`s of `GET /v1/stats`, and `BenchResult`, which derives the summary (throughput,
p50/p90/p99 latency, SLO attainment, errors by status), the per-step and per-second views, the text
table `patchkit bench` prints, and its JSON.

`run_bench` and `run_closed` (patchkit/bench/load.py) build a `BenchResult`; users and
`benchmarks/` read it, or rebuild one from a `--json` file with `BenchResult.from_dict`.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from patchkit.bench.plot import draw
from patchkit.bench.schedule import Schedule
from patchkit.errors import PatchkitError
from patchkit.tables import text_table

NO_REPLY = 0  # the status of a request that got no HTTP reply: refused, reset, timed out, or never sent
LAG_WARNING_MS = 50.0  # a p99 send lag past this says the generator, not the endpoint, set the pace
DROPPED = "ConcurrencyLimit"  # the error type of an arrival not sent because concurrency_limit requests were outstanding


@dataclass(slots=True)
class RequestRecord:
    """One arrival: when it was sent (s after the start), how late that was against its arrival time,
    its client-side latency, the HTTP status (0: no reply), the error type, whether it met the SLO,
    the endpoint's own latency for it (the `latency_ms` of a 200 reply; None without one), and, for a
    streamed request (`stream=True`), its time to first token: until its first delta event, else
    (the output came from no streaming call) until the whole answer."""

    sent_s: float
    lag_ms: float
    latency_ms: float
    status: int
    error: str | None = None
    slo_met: bool | None = None
    server_ms: float | None = None
    ttft_ms: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200


@dataclass(slots=True)
class ReplicaSample:
    """What `GET /v1/stats` said at `t_s` seconds after the start: replicas per component."""

    t_s: float
    replicas: dict[str, int]


def _percentile(ordered: Sequence[float], q: float) -> float | None:
    """Linear interpolation between the closest ranks (numpy's default); None for no values."""
    if not ordered:
        return None
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _latencies(records: Sequence[RequestRecord], ttft: bool = False) -> dict[str, float | None]:
    """Percentiles of the answered requests' latency (`ttft`: of their time to first token)."""
    ordered = sorted(r.ttft_ms if ttft and r.ttft_ms is not None else r.latency_ms for r in records
                     if r.ok and (not ttft or r.ttft_ms is not None))
    return {
        "p50": _percentile(ordered, 50),
        "p90": _percentile(ordered, 90),
        "p99": _percentile(ordered, 99),
        "mean": sum(ordered) / len(ordered) if ordered else None,
        "max": ordered[-1] if ordered else None,
    }


def _attainment(records: Sequence[RequestRecord], slo_ms: float | None) -> float | None:
    """The fraction of requests answered (200) within the SLO: errors count as misses."""
    if slo_ms is None or not records:
        return None
    return sum(bool(r.slo_met) for r in records) / len(records)


def _status_name(status: int) -> str:
    return "no reply" if status == NO_REPLY else str(status)


def lag_note(lag_ms: float) -> str:
    """What a send lag past LAG_WARNING_MS means: logged by `run_bench`, noted under the table."""
    return (f"the generator fell behind its arrival times (send lag p99 {lag_ms:.0f} ms): this machine, not the "
            "endpoint, may have limited the offered load")


@dataclass
class BenchResult:
    """What one run measured: an open loop (`run_bench`, which has a `schedule`) or a closed loop
    (`run_closed`, which has a `concurrency` instead). Latency percentiles are over the answered
    (200) requests; throughput counts those answered within the run's `seconds`, per second of it."""

    url: str
    seconds: float
    schedule: Schedule | None
    slo_ms: float | None
    seed: int
    elapsed_s: float  # the run and the wait for its last replies
    requests: list[RequestRecord] = field(default_factory=list)
    replicas: list[ReplicaSample] = field(default_factory=list)
    concurrency: int | None = None  # the clients of a closed loop

    def __post_init__(self) -> None:
        if (self.schedule is None) == (self.concurrency is None):
            raise PatchkitError(f"a BenchResult has a schedule (open loop) or a concurrency (closed loop), not both or "
                                f"neither; got schedule={self.schedule} and concurrency={self.concurrency}")

    def describe(self) -> str:
        """The load, in words: the schedule's rates, or the closed loop's clients."""
        if self.schedule is not None:
            return self.schedule.describe()
        return f"a closed loop of {self.concurrency} clients"

    def _answered_in_run(self, records: Sequence[RequestRecord], start: float, end: float) -> int:
        return sum(1 for r in records if r.ok and start <= r.sent_s + r.latency_ms / 1000 < end)

    def summary(self) -> dict[str, Any]:
        records = self.requests
        failed = [r for r in records if not r.ok]
        lags = sorted(r.lag_ms for r in records if r.error != DROPPED)
        return {
            "requests": len(records),
            "ok": len(records) - len(failed),
            "errors": len(failed),
            "errors_by_status": dict(sorted(Counter(_status_name(r.status) for r in failed).items())),
            "errors_by_type": dict(sorted(Counter(str(r.error) for r in failed).items())),
            "offered_rate": len(records) / self.seconds,
            "throughput": self._answered_in_run(records, 0.0, self.seconds) / self.seconds,
            "latency_ms": _latencies(records),
            "ttft_ms": _latencies(records, ttft=True) if any(r.ttft_ms is not None for r in records) else None,
            "slo_ms": self.slo_ms,
            "slo_attainment": _attainment(records, self.slo_ms),
            "send_lag_ms": {"p99": _percentile(lags, 99), "max": lags[-1] if lags else None},
            "elapsed_s": self.elapsed_s,
        }

    def steps(self) -> list[dict[str, Any]]:
        """The summary of each schedule step, by the time its requests were sent; none for a closed loop."""
        if self.schedule is None:
            return []
        found = []
        ends = self.schedule.ends(self.seconds)
        for i, ((start, rate), end) in enumerate(zip(self.schedule.steps, ends)):
            last = i == len(ends) - 1  # it also holds the few sent just after the end, late against their arrival
            records = [r for r in self.requests if start <= r.sent_s and (last or r.sent_s < end)]
            found.append({
                "start_s": start,
                "end_s": end,
                "rate": rate,
                "requests": len(records),
                "ok": sum(r.ok for r in records),
                "throughput": self._answered_in_run(self.requests, start, end) / (end - start),
                "latency_ms": _latencies(records),
                "slo_attainment": _attainment(records, self.slo_ms),
            })
        return found

    def series(self) -> dict[str, list[Any]]:
        """One value per second of the run: the scheduled rate (None in a closed loop), requests sent,
        answered (by the second they completed in), errors, and the latency and SLO attainment of the
        requests sent in it."""
        n = math.ceil(self.seconds)
        sent: list[list[RequestRecord]] = [[] for _ in range(n)]
        completed = [0] * n
        for r in self.requests:
            sent[min(int(r.sent_s), n - 1)].append(r)
            done = r.sent_s + r.latency_ms / 1000
            if r.ok and done < self.seconds:
                completed[int(done)] += 1
        latencies = [_latencies(records) for records in sent]
        schedule = self.schedule
        return {
            "t_s": list(range(n)),
            "offered_rate": [None if schedule is None else schedule.rate_at(t) for t in range(n)],
            "sent": [len(records) for records in sent],
            "completed_ok": completed,
            "errors": [sum(not r.ok for r in records) for records in sent],
            "p50_ms": [lat["p50"] for lat in latencies],
            "p99_ms": [lat["p99"] for lat in latencies],
            "slo_attainment": [_attainment(records, self.slo_ms) for records in sent],
        }

    def replica_series(self) -> dict[str, list[tuple[float, int]]]:
        """Per component, (t_s, replicas) at each stats poll that named it."""
        found: dict[str, list[tuple[float, int]]] = {}
        for sample in self.replicas:
            for name, count in sample.replicas.items():
                found.setdefault(name, []).append((sample.t_s, count))
        return found

    def table(self) -> str:
        """The report `patchkit bench` prints: the summary, each schedule step, errors, replicas."""

        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f}"

        def fraction(value: float | None) -> str:
            return "-" if value is None else f"{value:.4f}"

        s = self.summary()
        lat = s["latency_ms"]
        slo = "SLO attainment" + (f" (<= {self.slo_ms:g} ms)" if self.slo_ms is not None else "")
        rows = [
            ("requests", str(s["requests"])),
            ("ok", str(s["ok"])),
            ("errors", str(s["errors"])),
            ("offered (req/s)", f"{s['offered_rate']:.1f}"),
            ("throughput (req/s)", f"{s['throughput']:.1f}"),
            ("latency p50 (ms)", ms(lat["p50"])),
            ("latency p90 (ms)", ms(lat["p90"])),
            ("latency p99 (ms)", ms(lat["p99"])),
            ("latency max (ms)", ms(lat["max"])),
            *([("time to first token p50 (ms)", ms(s["ttft_ms"]["p50"])), ("time to first token p99 (ms)",
                                                                          ms(s["ttft_ms"]["p99"]))] if s["ttft_ms"] else []),
            (slo, fraction(s["slo_attainment"])),
            ("send lag p99 (ms)", ms(s["send_lag_ms"]["p99"])),
        ]
        seed = f" (seed {self.seed})" if self.schedule is not None else ""  # a closed loop draws no arrival times
        head = f"patchkit bench {self.url}: {self.describe()} for {self.seconds:g} s{seed}"
        parts = [head, text_table(["measure", "value"], rows)]
        lag = s["send_lag_ms"]["p99"]
        if lag is not None and lag > LAG_WARNING_MS:
            parts[-1] += f"\nnote: {lag_note(lag)}"
        if self.schedule is not None and len(self.schedule.steps) > 1:
            steps = [
                (f"{st['start_s']:g}-{st['end_s']:g} s", f"{st['rate']:g}", str(st["requests"]), f"{st['throughput']:.1f}",
                 ms(st["latency_ms"]["p50"]), ms(st["latency_ms"]["p99"]), fraction(st["slo_attainment"]))
                for st in self.steps()
            ]
            parts.append(text_table(["step", "rate", "requests", "throughput", "p50 ms", "p99 ms", "attainment"], steps))
        failed = Counter((_status_name(r.status), str(r.error)) for r in self.requests if not r.ok)
        if failed:
            errors = [(status, kind, str(count)) for (status, kind), count in sorted(failed.items())]
            parts.append(text_table(["status", "error", "count"], errors, left=2))
        replica_rows = [
            (name, str(points[0][1]), str(min(c for _, c in points)), str(max(c for _, c in points)), str(points[-1][1]))
            for name, points in sorted(self.replica_series().items())
        ]
        if replica_rows:
            parts.append(text_table(["component", "replicas first", "min", "max", "last"], replica_rows))
        return "\n\n".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """Everything: the run's settings, summary, steps, per-second series, replica samples, and every request."""
        return {
            "url": self.url,
            "seconds": self.seconds,
            "schedule": None if self.schedule is None else [list(step) for step in self.schedule.steps],
            "concurrency": self.concurrency,
            "slo_ms": self.slo_ms,
            "seed": self.seed,
            "elapsed_s": self.elapsed_s,
            "summary": self.summary(),
            "steps": self.steps(),
            "series": self.series(),
            "replicas": [asdict(sample) for sample in self.replicas],
            "requests": [asdict(record) for record in self.requests],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BenchResult:
        """A result back from `to_dict()` (or the `--json` file); the derived parts are recomputed."""
        steps = data["schedule"]
        return cls(
            url=data["url"],
            seconds=data["seconds"],
            schedule=None if steps is None else Schedule(tuple((float(start), float(rate)) for start, rate in steps)),
            slo_ms=data["slo_ms"],
            seed=data["seed"],
            elapsed_s=data["elapsed_s"],
            requests=[RequestRecord(**record) for record in data["requests"]],
            replicas=[ReplicaSample(**sample) for sample in data["replicas"]],
            concurrency=data.get("concurrency"),  # absent from files written before closed loops
        )

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def plot(self, path: str | Path) -> None:
        """A PNG in the style of Patchwork's Figure 15: latency (p50 and p99 per second, the SLO line),
        offered and achieved rate, and replicas per component, over the run's time."""
        draw(self, path)
