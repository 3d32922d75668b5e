"""The baseline servers: a pipeline served the way an author's reference code or a LangGraph app is.

    python -m benchmarks.baselines.server --system sequential --workload ircot-gpu --units cpu=2,gpu=2

Pre-fork, as gunicorn serves a Flask app: the parent opens one listening socket, builds the
workload's components, and forks one worker process per resource unit (`--units`, the budget
patchkit plans for). Every worker holds its own copy of every component (its `setup()` runs in the
worker) and accepts connections from the shared socket:

- `sequential`: a synchronous HTTP server (`http.server`), one request at a time, start to end;
- `langgraph`: an aiohttp server running concurrent `graph.ainvoke` calls; LangGraph runs the
  synchronous nodes on the event loop's thread pool.

The budget holds across workers as it does for patchkit's replicas: a copy of a component runs one
call at a time, and a call holds one unit of its component's resource type ("cpu" or "gpu") from a
semaphore shared by every worker, so no more calls run on a type at once than it has units. Math
libraries get one thread per worker.

Speaks patchkit's HTTP API (`POST /v1/query {"inputs": {...}}` -> `{"output", "request_id",
"latency_ms"}`, `GET /healthz`), so one load generator drives all three systems. Prints one JSON
line `{"url": ..., "pids": [...]}` once every worker is ready; SIGTERM stops the workers and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.server
import itertools
import json
import logging
import multiprocessing
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from patchkit.core import Component, ensure_setup

logger = logging.getLogger(__name__)

SYSTEMS = ("sequential", "langgraph")
READY_TIMEOUT_S = 600.0
LANGGRAPH_THREADS = 64  # the default executor's threads per worker: enough that the budget, not the pool, limits


class Replica:
    """One worker's copy of a component: one call at a time, each holding a unit of its resource type.

    Method calls pass straight through to the component (which runs them locally), so pipeline code
    reads `replica.retrieve(query)` as it would `component.retrieve(query)`.
    """

    def __init__(self, component: Component, units: Any) -> None:
        self._component = component
        self._units = units
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._component, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock, self._units:  # the copy first: a call waiting for it holds no unit
                return method(*args, **kwargs)

        return call


def parse_units(text: str) -> dict[str, int]:
    units = {}
    for part in text.split(","):
        kind, _, count = part.partition("=")
        if kind not in ("cpu", "gpu") or not count.isdigit() or int(count) < 1:
            raise SystemExit(f"--units takes kind=count pairs such as cpu=4,gpu=2; got {part!r}")
        units[kind] = int(count)
    return units


def _reply(output: Any, started: float, request_id: int) -> bytes:
    latency_ms = (time.perf_counter() - started) * 1000
    return json.dumps({"output": output, "request_id": request_id, "latency_ms": latency_ms}).encode()


def _error(exc: BaseException) -> bytes:
    return json.dumps({"error": {"type": type(exc).__name__, "message": str(exc)}}).encode()


# --- sequential: one request at a time per worker ----------------------------------------------------
def serve_sequential(sock: socket.socket, run: Callable[[Mapping[str, Any]], Any], ready: Callable[[], None]) -> None:
    ids = itertools.count(1)

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # one request per connection, as a synchronous worker serves

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._send(200 if self.path == "/healthz" else 404, b'{"status": "ok"}')

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            started = time.perf_counter()
            if self.path != "/v1/query":
                self._send(404, b'{"error": {"type": "NotFound", "message": "POST /v1/query"}}')
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                output = run(body["inputs"])
            except Exception as exc:  # noqa: BLE001 - the request fails, the server goes on
                self._send(500, _error(exc))
                return
            self._send(200, _reply(output, started, next(ids)))

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass

    class Server(http.server.HTTPServer):
        def handle_error(self, request: Any, client_address: Any) -> None:
            if not isinstance(sys.exc_info()[1], ConnectionError):  # a client that gave up waiting is no error here
                super().handle_error(request, client_address)

    server = Server(sock.getsockname(), Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    ready()
    while True:
        server._handle_request_noblock()  # a blocking accept: the worker that gets the connection serves it


# --- LangGraph: concurrent invocations per worker -----------------------------------------------------
def serve_langgraph(
    sock: socket.socket, graph: Any, invoke: Callable[[Any, Mapping[str, Any]], Any], ready: Callable[[], None]
) -> None:
    from aiohttp import web

    ids = itertools.count(1)

    async def query(request: web.Request) -> web.Response:
        started = time.perf_counter()
        try:
            body = await request.json()
            output = await invoke(graph, body["inputs"])
        except Exception as exc:  # noqa: BLE001 - the request fails, the server goes on
            return web.Response(status=500, body=_error(exc), content_type="application/json")
        return web.Response(body=_reply(output, started, next(ids)), content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def main() -> None:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(LANGGRAPH_THREADS))
        app = web.Application()
        app.router.add_post("/v1/query", query)
        app.router.add_get("/healthz", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock, backlog=4096).start()
        ready()
        await asyncio.Event().wait()

    asyncio.run(main())


# --- the parent: socket, components, workers ---------------------------------------------------------
def _watch_parent(parent: int) -> None:
    """A worker ends when the server process is gone, so none outlives it."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def worker(system: str, workload_name: str, components: dict[str, Component], sock: socket.socket,
           units: Mapping[str, Any], ready: int) -> None:
    """A forked worker: set up its copies of the components, say it is ready, serve until killed."""
    from benchmarks.baselines.workloads import WORKLOADS

    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    workload = WORKLOADS[workload_name]
    for component in components.values():
        ensure_setup(component)
    replicas = {name: Replica(c, units[c.devices[0]]) for name, c in components.items()}

    def say_ready() -> None:  # once it serves: a request that comes sooner must not wait on imports
        os.write(ready, b"r")
        os.close(ready)

    if system == "sequential":
        serve_sequential(sock, lambda inputs: workload.sequential(replicas, inputs), say_ready)
    else:
        steps = workload.resolved_steps()
        serve_langgraph(sock, workload.graph(replicas), steps.ainvoke, say_ready)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system", choices=SYSTEMS, required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--units", required=True, type=parse_units, help="the resource budget, as cpu=4,gpu=2")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    from benchmarks.baselines.workloads import WORKLOADS

    if args.workload not in WORKLOADS:
        raise SystemExit(f"--workload must be one of {', '.join(WORKLOADS)}; got {args.workload!r}")
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[name] = "1"  # one thread per worker, as patchkit gives each replica its share
    components = WORKLOADS[args.workload].build()
    if args.system == "langgraph":  # imported once, before the fork, rather than in every worker at once
        import aiohttp.web  # noqa: F401
        import langgraph.graph  # noqa: F401
    needed = {c.devices[0] for c in components.values()}
    if needed - set(args.units):
        raise SystemExit(f"--units names no {', '.join(sorted(needed - set(args.units)))} units, which the components need")
    sock = socket.create_server(("127.0.0.1", args.port), backlog=4096)
    context = multiprocessing.get_context("fork")
    units = {kind: context.BoundedSemaphore(count) for kind, count in args.units.items()}
    read_end, write_end = os.pipe()
    pids = []
    for _ in range(sum(args.units.values())):
        pid = os.fork()  # before any thread starts here: the workers inherit a single-threaded process
        if pid == 0:
            os.close(read_end)
            try:
                worker(args.system, args.workload, components, sock, units, write_end)
            except BaseException:  # noqa: BLE001 - a forked child must never return into the parent's code
                traceback.print_exc()
            finally:
                os._exit(1)
        pids.append(pid)
    os.close(write_end)
    signal.signal(signal.SIGTERM, lambda *_: _stop(pids))
    _wait_ready(read_end, len(pids), pids)
    print(json.dumps({"url": f"http://127.0.0.1:{sock.getsockname()[1]}", "pids": pids}), flush=True)
    while True:
        pid, _ = os.wait()
        logger.error("worker %d exited; stopping the server", pid)
        _stop(pids)


def _wait_ready(read_end: int, count: int, pids: list[int]) -> None:
    """Until every worker has set up its components; stops everything when one dies first or time runs out."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    got = 0
    while got < count:
        if time.monotonic() > deadline:
            _stop(pids, f"workers not ready after {READY_TIMEOUT_S:g} s")
        if os.waitpid(-1, os.WNOHANG)[0]:
            _stop(pids, "a worker failed to start (see its error above)")
        if select.select([read_end], [], [], 0.5)[0]:
            got += len(os.read(read_end, count - got))


def _stop(pids: list[int], reason: str | None = None) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    if reason:
        print(f"baseline server: {reason}", file=sys.stderr)
    os._exit(1 if reason else 0)


@contextlib.contextmanager
def running(system: str, workload: str, units: Mapping[str, int], cwd: str | os.PathLike[str]) -> Iterator[str]:
    """Serve `workload` with `system` in a subprocess on `units`; yields its URL; stops it (and every
    worker) on leaving. `cwd`: the directory `benchmarks` is importable from."""
    budget = ",".join(f"{kind}={count}" for kind, count in units.items())
    command = [sys.executable, "-m", "benchmarks.baselines.server", "--system", system, "--workload", workload, "--units", budget]
    process = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, text=True)  # noqa: S603
    try:
        line = process.stdout.readline() if process.stdout else ""
        if not line:
            raise RuntimeError(f"the {system} server for {workload} did not start (exit {process.wait()})")
        yield json.loads(line)["url"]
    finally:
        process.terminate()
        process.wait(30)
        if process.stdout:
            process.stdout.close()


if __name__ == "__main__":
    main()
