"""`patchkit bench URL`: an open-loop load generator for any patchkit endpoint.

    patchkit bench URL --rate 50 --seconds 30 --inputs '{"query": "..."}' [--inputs-file FILE.jsonl]
                       [--schedule "0:50,10:100,20:50"] [--slo-ms N] [--json out.json] [--plot out.png]

Requests arrive as a Poisson process (seeded, so a run's arrival times repeat), at one rate or at
a schedule of `seconds:rate` steps. The loop is open: each request is sent at its arrival time
whatever is still outstanding, so a slow endpoint shows as growing latency and errors, not as a
lower offered rate (a closed loop hides overload by waiting). Everything is sent from one event
loop and one aiohttp session. Once a second the generator reads `GET /v1/stats` and records each
component's replicas, so a plot shows scale-up next to the latency it answers.

`run_bench` returns a `BenchResult`: one `RequestRecord` per request, the replica samples, and
from them the summary (throughput, p50/p90/p99 latency, SLO attainment, errors by status), a
per-second series, a text table, JSON, and a Patchwork Figure 15 style plot (`pip install
'patchkit[bench]'` for matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from patchkit.errors import PatchkitError
from patchkit.tables import text_table

if TYPE_CHECKING:
    import aiohttp

__all__ = ["BenchResult", "ReplicaSample", "RequestRecord", "Schedule", "add_arguments", "main", "run_bench", "run_from_args"]

logger = logging.getLogger(__name__)

NO_REPLY = 0  # the status of a request that got no HTTP reply: refused, reset, timed out, or never sent
LAG_WARNING_MS = 50.0  # a p99 send lag past this says the generator, not the endpoint, set the pace
DROPPED = "ConcurrencyLimit"  # the error type of an arrival not sent because concurrency_limit requests were outstanding
_HEADERS = {"Content-Type": "application/json"}
_BENCH_EXTRA = "pip install 'patchkit[bench]'"


CHECK_QUERY_TIMEOUT_S = 120.0  # the first query, before the clock starts: a cold LLM pipeline is slow

@dataclass(frozen=True)
class Schedule:
    """Piecewise-constant arrival rates: `steps` are (start_s, requests per second), the first at 0 s."""

    steps: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise PatchkitError("the schedule has no steps")
        if self.steps[0][0] != 0:
            raise PatchkitError(f"the schedule must start at 0 s; its first step starts at {self.steps[0][0]:g} s")
        for (before, _), (after, _) in itertools.pairwise(self.steps):
            if after <= before:
                raise PatchkitError(f"schedule steps must be in increasing time order; {after:g} s comes after {before:g} s")
        for start, rate in self.steps:
            if not rate > 0 or math.isinf(rate):
                raise PatchkitError(f"the rate must be > 0 requests/s; got {rate:g} (at {start:g} s)")

    @classmethod
    def constant(cls, rate: float) -> Schedule:
        return cls(((0.0, float(rate)),))

    @classmethod
    def parse(cls, text: str) -> Schedule:
        """`"0:50,10:100,20:50"`: 50 requests/s from 0 s, 100 from 10 s, 50 again from 20 s."""
        steps = []
        for part in text.split(","):
            start, sep, rate = part.partition(":")
            try:
                if not sep:
                    raise ValueError
                steps.append((float(start), float(rate)))
            except ValueError:
                raise PatchkitError(f"--schedule takes seconds:rate steps such as 0:50,10:100; got {part.strip()!r}") from None
        return cls(tuple(steps))

    def check_fits(self, seconds: float) -> None:
        """Every step must start inside the run, or the schedule says something the run never does."""
        last = self.steps[-1][0]
        if last >= seconds:
            raise PatchkitError(f"the schedule's step at {last:g} s starts after the run ends (seconds={seconds:g})")

    def rate_at(self, t: float) -> float:
        return next(rate for start, rate in reversed(self.steps) if start <= t)

    def ends(self, seconds: float) -> list[float]:
        """The end of each step: the next step's start, and `seconds` for the last."""
        return [start for start, _ in self.steps[1:]] + [seconds]

    def arrivals(self, seconds: float, rng: random.Random) -> list[float]:
        """Arrival times in [0, seconds): exponential gaps at each step's rate. Gaps are memoryless, so
        starting afresh at each step boundary gives exactly a Poisson process of the scheduled rate."""
        times: list[float] = []
        for (start, rate), end in zip(self.steps, self.ends(seconds)):
            t = start + rng.expovariate(rate)
            while t < end:
                times.append(t)
                t += rng.expovariate(rate)
        return times

    def describe(self) -> str:
        if len(self.steps) == 1:
            return f"{self.steps[0][1]:g} req/s"
        return ", ".join(f"{rate:g} req/s from {start:g} s" for start, rate in self.steps)


@dataclass(slots=True)
class RequestRecord:
    """One arrival: when it was sent (s after the start), how late that was against its arrival time,
    its client-side latency, the HTTP status (0: no reply), the error type, and whether it met the SLO."""

    sent_s: float
    lag_ms: float
    latency_ms: float
    status: int
    error: str | None = None
    slo_met: bool | None = None

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


def _latencies(records: Sequence[RequestRecord]) -> dict[str, float | None]:
    ordered = sorted(r.latency_ms for r in records if r.ok)
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


@dataclass
class BenchResult:
    """What one `run_bench` measured. Latency percentiles are over the answered (200) requests;
    throughput counts those answered within the run's `seconds`, per second of it."""

    url: str
    seconds: float
    schedule: Schedule
    slo_ms: float | None
    seed: int
    elapsed_s: float  # the run and the wait for its last replies
    requests: list[RequestRecord] = field(default_factory=list)
    replicas: list[ReplicaSample] = field(default_factory=list)

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
            "slo_ms": self.slo_ms,
            "slo_attainment": _attainment(records, self.slo_ms),
            "send_lag_ms": {"p99": _percentile(lags, 99), "max": lags[-1] if lags else None},
            "elapsed_s": self.elapsed_s,
        }

    def steps(self) -> list[dict[str, Any]]:
        """The summary of each schedule step, by the time its requests were sent."""
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
        """One value per second of the run: the scheduled rate, requests sent, answered (by the second
        they completed in), errors, and the latency and SLO attainment of the requests sent in it."""
        n = math.ceil(self.seconds)
        sent: list[list[RequestRecord]] = [[] for _ in range(n)]
        completed = [0] * n
        for r in self.requests:
            sent[min(int(r.sent_s), n - 1)].append(r)
            done = r.sent_s + r.latency_ms / 1000
            if r.ok and done < self.seconds:
                completed[int(done)] += 1
        latencies = [_latencies(records) for records in sent]
        return {
            "t_s": list(range(n)),
            "offered_rate": [self.schedule.rate_at(t) for t in range(n)],
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
            (slo, fraction(s["slo_attainment"])),
            ("send lag p99 (ms)", ms(s["send_lag_ms"]["p99"])),
        ]
        head = f"patchkit bench {self.url}: {self.schedule.describe()} for {self.seconds:g} s (seed {self.seed})"
        parts = [head, text_table(["measure", "value"], rows)]
        lag = s["send_lag_ms"]["p99"]
        if lag is not None and lag > LAG_WARNING_MS:
            parts[-1] += f"\nnote: {_behind(lag)}"
        if len(self.schedule.steps) > 1:
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
            "schedule": [list(step) for step in self.schedule.steps],
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
        return cls(
            url=data["url"],
            seconds=data["seconds"],
            schedule=Schedule(tuple((float(start), float(rate)) for start, rate in data["schedule"])),
            slo_ms=data["slo_ms"],
            seed=data["seed"],
            elapsed_s=data["elapsed_s"],
            requests=[RequestRecord(**record) for record in data["requests"]],
            replicas=[ReplicaSample(**sample) for sample in data["replicas"]],
        )

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    def plot(self, path: str | Path) -> None:
        """A PNG in the style of Patchwork's Figure 15: latency (p50 and p99 per second, the SLO line),
        offered and achieved rate, and replicas per component, over the run's time."""
        plt = _pyplot()
        from matplotlib.ticker import MaxNLocator

        series = self.series()
        t = [x + 0.5 for x in series["t_s"]]  # a second's values at its middle
        figure, (latency, rate, replicas) = plt.subplots(3, 1, sharex=True, figsize=(8, 8), constrained_layout=True)
        latency.plot(t, [float("nan") if v is None else v for v in series["p50_ms"]], marker=".", label="p50")
        latency.plot(t, [float("nan") if v is None else v for v in series["p99_ms"]], marker=".", label="p99")
        if self.slo_ms is not None:
            latency.axhline(self.slo_ms, color="red", linestyle="--", label=f"SLO {self.slo_ms:g} ms")
        latency.set_ylabel("latency (ms)")
        latency.set_ylim(bottom=0)
        latency.set_title(f"{self.url}: {self.schedule.describe()}")
        latency.legend(loc="best")
        steps_t = [start for start, _ in self.schedule.steps] + [self.seconds]
        steps_rate = [rate for _, rate in self.schedule.steps]
        rate.stairs(steps_rate, steps_t, baseline=None, color="gray", linestyle="--", label="offered (schedule)")
        rate.plot(t, series["sent"], marker=".", label="sent")
        rate.plot(t, series["completed_ok"], marker=".", label="achieved (ok)")
        rate.set_ylabel("requests/s")
        rate.set_ylim(0, 1.4 * max([*steps_rate, *series["sent"], *series["completed_ok"]]))  # room for the legend
        rate.legend(loc="upper left", ncol=3)
        most = 1
        for name, points in sorted(self.replica_series().items()):
            times, counts = [p[0] for p in points], [p[1] for p in points]
            replicas.step([*times, self.seconds], [*counts, counts[-1]], where="post", label=name)
            most = max(most, *counts)
        replicas.set_ylabel("replicas")
        replicas.set_xlabel("time (s)")
        replicas.set_xlim(0, self.seconds)
        replicas.set_ylim(0, most + 1)
        replicas.yaxis.set_major_locator(MaxNLocator(integer=True))
        if self.replicas:
            replicas.legend(loc="upper left")
        figure.savefig(str(path), dpi=120)
        plt.close(figure)


def _behind(lag_ms: float) -> str:
    return (f"the generator fell behind its arrival times (send lag p99 {lag_ms:.0f} ms): this machine, not the "
            "endpoint, may have limited the offered load")


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), or an error naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise PatchkitError(f"--plot needs matplotlib, which is not installed: {_BENCH_EXTRA}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class _Generator:
    """The open loop: `run` sends each arrival at its time from one event loop, while `_poll_stats`
    reads replicas once a second. Requests append their record when they end."""

    def __init__(
        self, url: str, bodies: list[bytes], arrivals: list[float], slo_ms: float | None, concurrency_limit: int,
    ) -> None:
        self.url = url
        self.bodies = bodies
        self.arrivals = arrivals
        self.slo_ms = slo_ms
        self.concurrency_limit = concurrency_limit
        self.records: list[RequestRecord] = []
        self.replicas: list[ReplicaSample] = []
        self.outstanding = 0
        self.start = 0.0

    async def run(self, session: aiohttp.ClientSession, seconds: float) -> float:
        """Send every arrival, wait for every reply; return the seconds that took."""
        tasks: set[asyncio.Task[None]] = set()
        self.start = time.perf_counter()
        poller = asyncio.create_task(self._poll_stats(session))
        bodies = itertools.cycle(self.bodies)
        for arrival in self.arrivals:
            delay = self.start + arrival - time.perf_counter()
            # Behind schedule, send at once but still yield now and then, so the sent requests start.
            await asyncio.sleep(delay if delay > 0 else 0)
            body = next(bodies)
            if self.outstanding >= self.concurrency_limit:
                now = time.perf_counter() - self.start
                self.records.append(RequestRecord(now, (now - arrival) * 1000, 0.0, NO_REPLY, DROPPED, False))
                continue
            self.outstanding += 1  # counted now, not when the task starts, so a burst cannot overshoot the limit
            task = asyncio.create_task(self._send(session, body, arrival))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks)
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        return time.perf_counter() - self.start

    async def _send(self, session: aiohttp.ClientSession, body: bytes, arrival: float) -> None:
        sent = time.perf_counter()
        status, error, payload = NO_REPLY, None, b""
        try:
            async with session.post(self.url + "/v1/query", data=body, headers=_HEADERS) as response:
                payload = await response.read()
                status = response.status
        except Exception as exc:  # refused, reset, timed out, a bad reply: each is this request's error, and counted
            error = type(exc).__name__
        latency_ms = (time.perf_counter() - sent) * 1000
        self.outstanding -= 1
        if status not in (200, NO_REPLY):
            error = _error_type(payload, status)
        sent_s = sent - self.start
        met = None if self.slo_ms is None else status == 200 and latency_ms <= self.slo_ms
        self.records.append(RequestRecord(sent_s, (sent_s - arrival) * 1000, latency_ms, status, error, met))

    async def _poll_stats(self, session: aiohttp.ClientSession) -> None:
        """Once a second, on the second: replicas per component, and a progress line for the log."""
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=5.0)
        tick = 0
        while True:
            now = time.perf_counter() - self.start
            try:
                async with session.get(self.url + "/v1/stats", timeout=timeout) as response:
                    stats = await response.json() if response.status == 200 else None
            except Exception:
                stats = None  # the endpoint is busy or down: the requests' own errors tell that story
            components = stats.get("components") if isinstance(stats, dict) else None
            if isinstance(components, dict):
                replicas = {name: len(c.get("replicas", [])) for name, c in components.items() if isinstance(c, dict)}
                self.replicas.append(ReplicaSample(now, replicas))
            ok = sum(r.ok for r in self.records)
            logger.info("%3.0f s: sent %d, ok %d, errors %d, outstanding %d", now, len(self.records) + self.outstanding, ok,
                        len(self.records) - ok, self.outstanding)
            tick = max(tick + 1, math.ceil(time.perf_counter() - self.start))
            await asyncio.sleep(self.start + tick - time.perf_counter())


def _error_type(payload: bytes, status: int) -> str:
    """The `error.type` of a patchkit error reply, else `HTTP <status>`."""
    try:
        kind = json.loads(payload)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"
    return str(kind)


def _base_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise PatchkitError(f"the endpoint URL must start with http:// or https://; got {url!r}")
    url = url.rstrip("/")
    return url.removesuffix("/v1/query")  # the query URL itself names the same endpoint


def _bodies(inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]], slo_ms: float | None) -> list[bytes]:
    """Each request body, encoded once before the run so that sending costs no JSON work."""
    listed = [inputs] if isinstance(inputs, Mapping) else list(inputs)
    if not listed:
        raise PatchkitError("inputs is empty: give at least one inputs object")
    bodies = []
    for i, one in enumerate(listed):
        if not isinstance(one, Mapping):
            raise PatchkitError(f"inputs must be JSON objects such as {{\"query\": \"...\"}}; item {i} is {one!r}")
        body: dict[str, Any] = {"inputs": dict(one)}
        if slo_ms is not None:
            body["slo_ms"] = slo_ms
        try:
            bodies.append(json.dumps(body).encode())
        except (TypeError, ValueError) as exc:
            raise PatchkitError(f"inputs item {i} is not JSON-serialisable: {exc}") from None
    return bodies


async def _check_endpoint(session: aiohttp.ClientSession, url: str, body: bytes, query_timeout_s: float) -> None:
    """Before the clock starts: the endpoint answers /healthz within 10 s, and answers the first inputs
    (a 400 would make every request of the run fail the same way) within `query_timeout_s`: a cold
    pipeline of LLM calls may take a while, and this first answer warms it for the run."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=10.0)
    try:
        async with session.get(url + "/healthz", timeout=timeout) as response:
            health = await response.text()
            if response.status == 503:
                raise PatchkitError(f"the endpoint at {url} is not healthy (GET /healthz: 503 {health.strip()})")
            if response.status != 200:
                logger.warning("GET %s/healthz answered %d; benchmarking anyway", url, response.status)
        first = aiohttp.ClientTimeout(total=query_timeout_s)
        async with session.post(url + "/v1/query", data=body, headers=_HEADERS, timeout=first) as response:
            reply = await response.read()
            status = response.status
    except TimeoutError:
        raise PatchkitError(f"the endpoint at {url} did not answer GET /healthz within 10 s or its first query within "
                            f"{query_timeout_s:g} s; is it overloaded or stuck?") from None
    except (aiohttp.ClientError, OSError) as exc:
        raise PatchkitError(f"cannot reach the endpoint at {url} ({type(exc).__name__}: {exc}); is it running?") from None
    if status in (400, 413):
        try:
            message = json.loads(reply)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = reply.decode(errors="replace")[:200]
        raise PatchkitError(f"the endpoint rejects the inputs ({status}): {message}")


def run_bench(
    url: str,
    *,
    rate: float | None = None,
    schedule: Schedule | str | Sequence[tuple[float, float]] | None = None,
    seconds: float,
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    slo_ms: float | None = None,
    concurrency_limit: int = 4096,
    timeout_s: float = 30.0,
    seed: int = 0,
) -> BenchResult:
    """Send Poisson arrivals at `rate` (or at `schedule`'s steps) to the endpoint at `url` for
    `seconds`, then wait for the replies; blocks, running its own event loop.

    `inputs`: one inputs object, or several that the requests take in turn. `slo_ms`: the latency
    target a request must meet at the client; the requests carry it too. `concurrency_limit`: a
    guard for this process, not a closed loop: an arrival while that many requests are outstanding
    is not sent and counts as an error (`ConcurrencyLimit`); the default is an endpoint's default
    `max_inflight_requests`, past which it answers 503 anyway. `timeout_s`: a request unanswered by
    then counts as an error. Raises PatchkitError, before sending any load, for bad arguments, an
    endpoint that cannot be reached or is unhealthy, or inputs it rejects.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # no loop running here: run_bench runs its own
    else:
        raise PatchkitError("run_bench blocks and runs its own event loop; from async code (a notebook) call it in a thread: "
                            "await asyncio.to_thread(run_bench, url, ...)")
    if (rate is None) == (schedule is None):
        raise PatchkitError("give either rate= or schedule=")
    if isinstance(schedule, Schedule):
        steps = schedule
    elif isinstance(schedule, str):
        steps = Schedule.parse(schedule)
    elif schedule is not None:
        steps = Schedule(tuple((float(start), float(r)) for start, r in schedule))
    else:
        assert rate is not None
        steps = Schedule.constant(rate)
    if not seconds > 0:
        raise PatchkitError(f"seconds must be > 0; got {seconds}")
    steps.check_fits(seconds)
    if slo_ms is not None and not slo_ms > 0:
        raise PatchkitError(f"slo_ms must be > 0; got {slo_ms}")
    if concurrency_limit < 1:
        raise PatchkitError(f"concurrency_limit must be >= 1; got {concurrency_limit}")
    if not timeout_s > 0:
        raise PatchkitError(f"timeout_s must be > 0; got {timeout_s}")
    base = _base_url(url)
    bodies = _bodies(inputs, slo_ms)
    arrivals = steps.arrivals(seconds, random.Random(seed))  # noqa: S311 - load, not secrets
    generator = _Generator(base, bodies, arrivals, slo_ms, concurrency_limit)

    async def main() -> float:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)  # open loop: no pool limit may hold a request back
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            await _check_endpoint(session, base, bodies[0], max(timeout_s, CHECK_QUERY_TIMEOUT_S))
            logger.info("sending %d requests to %s over %g s (%s)", len(arrivals), base, seconds, steps.describe())
            return await generator.run(session, seconds)

    elapsed = asyncio.run(main())
    records = sorted(generator.records, key=lambda r: r.sent_s)
    result = BenchResult(base, float(seconds), steps, slo_ms, seed, elapsed, records, generator.replicas)
    lag = result.summary()["send_lag_ms"]["p99"]
    if lag is not None and lag > LAG_WARNING_MS:
        logger.warning("%s", _behind(lag))
    return result


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
    parser.add_argument("--json", metavar="FILE", help="write the summary, series and every request as JSON")
    parser.add_argument("--plot", metavar="FILE", help=f"write a PNG of latency, rates and replicas ({_BENCH_EXTRA})")


def run_from_args(args: argparse.Namespace, out: Callable[[str], None] = print) -> int:
    """`patchkit bench` after parsing: run, print the table, write --json and --plot."""
    inputs = _read_inputs(args)
    if args.plot is not None:
        _pyplot()  # missing matplotlib should stop the run before it, not after
    result = run_bench(
        args.url, rate=args.rate, schedule=args.schedule, seconds=args.seconds, inputs=inputs, slo_ms=args.slo_ms,
        concurrency_limit=args.concurrency_limit, timeout_s=args.timeout_s, seed=args.seed,
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
    parser = argparse.ArgumentParser(prog="patchkit bench", description="Open-loop Poisson load against a patchkit endpoint.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except PatchkitError as exc:
        print(f"patchkit bench: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
