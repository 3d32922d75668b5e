"""The load generators behind `patchkit bench`: `run_bench`, an open loop of Poisson arrivals, and
`run_closed`, a closed loop of concurrent clients. Both block, run their own event loop and one
aiohttp session, check the endpoint before the clock starts, and return a `BenchResult`.

The open loop sends each request at its arrival time whatever is still outstanding, so a slow
endpoint shows as growing latency and errors, not as a lower offered rate. The closed loop keeps
`concurrency` requests outstanding, each client sending its next as soon as its last is answered:
it hides overload by waiting, which is what a saturation measurement (the most an endpoint can
answer) wants. Once a second either reads `GET /v1/stats` and records each component's replicas.

Called by `patchkit bench` (patchkit/bench/cli.py), by users as `patchkit.bench.run_bench`, and by
the scripts in `benchmarks/`.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from patchkit.bench.report import DROPPED, LAG_WARNING_MS, NO_REPLY, BenchResult, ReplicaSample, RequestRecord, lag_note
from patchkit.bench.schedule import Schedule
from patchkit.errors import PatchkitError

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

CHECK_QUERY_TIMEOUT_S = 120.0  # the first query, before the clock starts: a cold LLM pipeline is slow
_HEADERS = {"Content-Type": "application/json"}


class _Generator:
    """Sends the requests of one run from one event loop: `open_loop` at arrival times, or
    `closed_loop` from concurrent clients, while `_poll_stats` reads replicas once a second.
    Requests append their record when they end."""

    def __init__(self, url: str, bodies: list[bytes], slo_ms: float | None, stream: bool = False) -> None:
        self.url = url
        self.bodies = bodies
        self.slo_ms = slo_ms
        self.stream = stream  # the bodies ask for server-sent events: the records get their time to first token
        self.records: list[RequestRecord] = []
        self.replicas: list[ReplicaSample] = []
        self.outstanding = 0
        self.start = 0.0

    async def open_loop(self, session: aiohttp.ClientSession, arrivals: list[float], concurrency_limit: int) -> float:
        """Send every arrival, wait for every reply; return the seconds that took."""
        tasks: set[asyncio.Task[None]] = set()
        bodies = itertools.cycle(self.bodies)

        async def send_all() -> None:
            for arrival in arrivals:
                delay = self.start + arrival - time.perf_counter()
                # Behind schedule, send at once but still yield now and then, so the sent requests start.
                await asyncio.sleep(delay if delay > 0 else 0)
                body = next(bodies)
                if self.outstanding >= concurrency_limit:
                    now = time.perf_counter() - self.start
                    self.records.append(RequestRecord(now, (now - arrival) * 1000, 0.0, NO_REPLY, DROPPED, False))
                    continue
                self.outstanding += 1  # counted now, not when the task starts, so a burst cannot overshoot the limit
                task = asyncio.create_task(self._send(session, body, arrival))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.wait(tasks)

        return await self._timed(session, send_all)

    async def closed_loop(self, session: aiohttp.ClientSession, seconds: float, concurrency: int) -> float:
        """`concurrency` clients, each sending its next request when its last is answered, until
        `seconds` have passed; return the seconds until the last reply."""
        bodies = itertools.cycle(self.bodies)

        async def client() -> None:
            while (now := time.perf_counter() - self.start) < seconds:
                self.outstanding += 1
                await self._send(session, next(bodies), now)  # arrives when sent: no lag

        async def send_all() -> None:
            await asyncio.gather(*(client() for _ in range(concurrency)))

        return await self._timed(session, send_all)

    async def _timed(self, session: aiohttp.ClientSession, send_all: Callable[[], Awaitable[None]]) -> float:
        """Start the clock and the stats poller, run `send_all`; return the seconds it took."""
        self.start = time.perf_counter()
        poller = asyncio.create_task(self._poll_stats(session))
        await send_all()
        poller.cancel()
        await asyncio.gather(poller, return_exceptions=True)
        return time.perf_counter() - self.start

    async def _send(self, session: aiohttp.ClientSession, body: bytes, arrival: float) -> None:
        sent = time.perf_counter()
        status, error, payload, first = NO_REPLY, None, b"", None
        try:
            async with session.post(self.url + "/v1/query", data=body, headers=_HEADERS) as response:
                if response.content_type == "text/event-stream":
                    payload, first = await _read_events(response.content)
                    status = 500 if payload.startswith(b'{"error"') else response.status  # an error after the stream began
                else:
                    payload = await response.read()
                    status = response.status
        except Exception as exc:  # refused, reset, timed out, a bad reply: each is this request's error, and counted
            error = type(exc).__name__
        done = time.perf_counter()
        latency_ms = (done - sent) * 1000
        ttft_ms = None if not self.stream or status != 200 else ((first or done) - sent) * 1000
        self.outstanding -= 1
        if status not in (200, NO_REPLY):
            error = _error_type(payload, status)
        sent_s = sent - self.start
        met = None if self.slo_ms is None else status == 200 and latency_ms <= self.slo_ms
        server_ms = _server_latency_ms(payload) if status == 200 else None
        record = RequestRecord(sent_s, (sent_s - arrival) * 1000, latency_ms, status, error, met, server_ms=server_ms,
                               ttft_ms=ttft_ms)
        self.records.append(record)

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


async def _read_events(content: aiohttp.StreamReader) -> tuple[bytes, float | None]:
    """A streamed reply read to its end: the data of its last event before `event: end` (the reply, or the
    error), and when its first delta event arrived (None: none did)."""
    last, first, pending, ending = b"", None, b"", False
    async for piece in content.iter_any():  # not line by line: a long output makes a line past aiohttp's line limit
        *lines, pending = (pending + piece).split(b"\n")
        for line in lines:
            if line.startswith(b"event: "):
                ending = line[7:].strip() == b"end"
            elif line.startswith(b"data: ") and not ending:
                last = line[6:].strip()
                if first is None and last.startswith(b'{"delta"'):
                    first = time.perf_counter()
            elif not line.strip():
                ending = False
    return last, first


def _error_type(payload: bytes, status: int) -> str:
    """The `error.type` of a patchkit error reply, else `HTTP <status>`."""
    try:
        kind = json.loads(payload)["error"]["type"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}"
    return str(kind)


def _server_latency_ms(payload: bytes) -> float | None:
    """The `latency_ms` the endpoint reports for a request it answered; None where the reply has none."""
    try:
        return float(json.loads(payload)["latency_ms"])
    except (ValueError, KeyError, TypeError):
        return None


def _base_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise PatchkitError(f"the endpoint URL must start with http:// or https://; got {url!r}")
    url = url.rstrip("/")
    return url.removesuffix("/v1/query")  # the query URL itself names the same endpoint


def _bodies(inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]], slo_ms: float | None, stream: bool = False) -> list[bytes]:
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
        if stream:
            body["stream"] = True
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


def _check_run(caller: str, seconds: float, slo_ms: float | None, timeout_s: float) -> None:
    """The settings both loops share, checked before any load; and neither may run inside an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass  # no loop running here: the run gets its own
    else:
        raise PatchkitError(f"{caller} blocks and runs its own event loop; from async code (a notebook) call it in a thread: "
                            f"await asyncio.to_thread({caller}, url, ...)")
    if not seconds > 0:
        raise PatchkitError(f"seconds must be > 0; got {seconds}")
    if slo_ms is not None and not slo_ms > 0:
        raise PatchkitError(f"slo_ms must be > 0; got {slo_ms}")
    if not timeout_s > 0:
        raise PatchkitError(f"timeout_s must be > 0; got {timeout_s}")


def _drive(
    generator: _Generator, timeout_s: float, load: str, send: Callable[[aiohttp.ClientSession], Awaitable[float]],
) -> float:
    """Open the session, check the endpoint, then run `send` in a new event loop; return its seconds."""

    async def main() -> float:
        import aiohttp

        connector = aiohttp.TCPConnector(limit=0)  # no pool limit may hold a request back
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            await _check_endpoint(session, generator.url, generator.bodies[0], max(timeout_s, CHECK_QUERY_TIMEOUT_S))
            logger.info("sending %s to %s", load, generator.url)
            return await send(session)

    return asyncio.run(main())


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
    stream: bool = False,
) -> BenchResult:
    """Send Poisson arrivals at `rate` (or at `schedule`'s steps) to the endpoint at `url` for
    `seconds`, then wait for the replies; blocks, running its own event loop.

    `inputs`: one inputs object, or several that the requests take in turn. `slo_ms`: the latency
    target a request must meet at the client; the requests carry it too. `concurrency_limit`: a
    guard for this process, not a closed loop: an arrival while that many requests are outstanding
    is not sent and counts as an error (`ConcurrencyLimit`); the default is an endpoint's default
    `max_inflight_requests`, past which it answers 503 anyway. `timeout_s`: a request unanswered by
    then counts as an error. `stream`: ask for server-sent events and report the time to first token
    (the first delta, else the whole answer) beside latency. Raises PatchkitError, before sending any
    load, for bad arguments, an endpoint that cannot be reached or is unhealthy, or inputs it rejects.
    """
    _check_run("run_bench", seconds, slo_ms, timeout_s)
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
    steps.check_fits(seconds)
    if concurrency_limit < 1:
        raise PatchkitError(f"concurrency_limit must be >= 1; got {concurrency_limit}")
    generator = _Generator(_base_url(url), _bodies(inputs, slo_ms, stream), slo_ms, stream)
    arrivals = steps.arrivals(seconds, random.Random(seed))  # noqa: S311 - load, not secrets
    load = f"{len(arrivals)} requests over {seconds:g} s ({steps.describe()})"
    elapsed = _drive(generator, timeout_s, load, lambda session: generator.open_loop(session, arrivals, concurrency_limit))
    records = sorted(generator.records, key=lambda r: r.sent_s)
    result = BenchResult(generator.url, float(seconds), steps, slo_ms, seed, elapsed, records, generator.replicas)
    lag = result.summary()["send_lag_ms"]["p99"]
    if lag is not None and lag > LAG_WARNING_MS:
        logger.warning("%s", lag_note(lag))
    return result


def run_closed(
    url: str,
    *,
    concurrency: int,
    seconds: float,
    inputs: Mapping[str, Any] | Sequence[Mapping[str, Any]],
    slo_ms: float | None = None,
    timeout_s: float = 30.0,
    stream: bool = False,
) -> BenchResult:
    """Run `concurrency` clients against the endpoint at `url` for `seconds`, each sending its next
    request as soon as its last is answered, then wait for the replies; blocks, running its own
    event loop. This finds the most the endpoint can answer (throughput at saturation); for latency
    under a given load use `run_bench`, whose open loop does not slow down when the endpoint does.

    `inputs`, `slo_ms`, `timeout_s` and `stream` are as for `run_bench`. The result has no schedule: its
    `concurrency` says what the load was, and every record's send lag is 0. Raises PatchkitError,
    before sending any load, for the same reasons as `run_bench`.
    """
    _check_run("run_closed", seconds, slo_ms, timeout_s)
    if concurrency < 1:
        raise PatchkitError(f"concurrency must be >= 1; got {concurrency}")
    generator = _Generator(_base_url(url), _bodies(inputs, slo_ms, stream), slo_ms, stream)
    load = f"a closed loop of {concurrency} clients for {seconds:g} s"
    elapsed = _drive(generator, timeout_s, load, lambda session: generator.closed_loop(session, seconds, concurrency))
    records = sorted(generator.records, key=lambda r: r.sent_s)
    return BenchResult(generator.url, float(seconds), None, slo_ms, 0, elapsed, records, generator.replicas,
                       concurrency=concurrency)
