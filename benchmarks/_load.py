"""Load generators for the benchmarks, run in a process of their own so they never share the
front-end's interpreter: open-loop Poisson arrivals, or a closed loop of concurrent clients.

    python benchmarks/_load.py poisson URL RATE SECONDS BODY_JSON
    python benchmarks/_load.py closed URL CONCURRENCY SECONDS BODY_JSON

BODY_JSON is one request body, or a JSON list of bodies that the requests take in turn. Prints one
JSON line: sent, ok, errors, elapsed_s, client latencies (ms) and server latencies (ms).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time

import aiohttp


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, out: dict) -> None:
    start = time.perf_counter()
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as response:
            data = await response.read()
            status = response.status
    except aiohttp.ClientError:
        out["errors"] += 1
        return
    if status != 200:
        out["errors"] += 1
        return
    out["ok"] += 1
    out["client_ms"].append((time.perf_counter() - start) * 1000)
    out["server_ms"].append(json.loads(data)["latency_ms"])


async def poisson(url: str, rate: float, seconds: float, bodies: itertools.cycle) -> dict:
    out: dict = {"sent": 0, "ok": 0, "errors": 0, "client_ms": [], "server_ms": []}
    rng = random.Random(0)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        tasks, start = set(), time.perf_counter()
        next_at = start
        while next_at - start < seconds:
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.ensure_future(_one(session, url, next(bodies), out))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            out["sent"] += 1
            next_at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
        out["elapsed_s"] = time.perf_counter() - start
    return out


async def closed(url: str, concurrency: int, seconds: float, bodies: itertools.cycle) -> dict:
    out: dict = {"sent": 0, "ok": 0, "errors": 0, "client_ms": [], "server_ms": []}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()

        async def client() -> None:
            while time.perf_counter() - start < seconds:
                out["sent"] += 1
                await _one(session, url, next(bodies), out)

        await asyncio.gather(*(client() for _ in range(concurrency)))
        out["elapsed_s"] = time.perf_counter() - start
    return out


def main() -> None:
    mode, url, level, seconds, body = sys.argv[1:6]
    run = poisson if mode == "poisson" else closed
    level_value = float(level) if mode == "poisson" else int(level)
    parsed = json.loads(body)
    bodies = itertools.cycle([json.dumps(b).encode() for b in parsed] if isinstance(parsed, list) else [body.encode()])
    result = asyncio.run(run(url + "/v1/query", level_value, float(seconds), bodies))  # type: ignore[arg-type]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
