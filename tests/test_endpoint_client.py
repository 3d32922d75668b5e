"""`Endpoint` talks to a real front-end through one pooled client: `query` from any number of threads
and `aquery` on an event loop reuse kept-alive connections, every call has a timeout, and `close()`
(or the end of the loop) closes them.

A counting TCP proxy stands between the client and a real endpoint (the inprocess backend's HTTP
front-end): the connections it accepts are the connections the client opened.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import patchkit
from patchkit.components.testing import Simulated


class Proxy:
    """Forwards TCP connections to `upstream` (or, with `stall`, reads and never answers), counting them."""

    def __init__(self, upstream: str | None) -> None:
        self.upstream = upstream
        self.accepted = 0
        self.open = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        try:
            if self.upstream is None:
                while await reader.read(65536):  # stall: take the request, answer nothing
                    pass
                return
            host, port = self.upstream.removeprefix("http://").split(":")
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self.open -= 1
            writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for task in asyncio.all_tasks() - {asyncio.current_task()}:
                task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def _wait_until(condition: Any, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting until {what}"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def served() -> Iterator[str]:
    """A real endpoint (the HTTP front-end on a thread of this process) of `answer = a.run(x)`, x -> -x."""
    a = Simulated(0, output=lambda item: -item)
    x = 1
    with patchkit.capture(run=False) as pipeline:
        answer = a.run(x)  # noqa: F841 - the block's output
    with patchkit.deploy(pipeline, backend="inprocess") as endpoint:
        yield endpoint.url


@pytest.fixture
def proxy(served: str) -> Iterator[Proxy]:
    proxy = Proxy(served)
    yield proxy
    proxy.close()


def test_calls_from_many_threads_one_after_another_share_one_connection(proxy: Proxy) -> None:
    client = patchkit.Endpoint(proxy.url, lambda: None)
    answers: list[Any] = []
    for i in range(20):  # each from a new thread, as a thread pool's or a web server's
        thread = threading.Thread(target=lambda i=i: answers.append(client.query(x=i)))
        thread.start()
        thread.join()
    assert answers == [-i for i in range(20)]
    assert proxy.accepted == 1
    client.close()
    _wait_until(lambda: proxy.open == 0, "close() closed the pooled connection")


def test_concurrent_threads_get_a_connection_each_and_keep_them_for_the_next_calls(proxy: Proxy) -> None:
    client = patchkit.Endpoint(proxy.url, lambda: None)
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            assert list(pool.map(lambda i: client.query(x=i), range(4))) == [0, -1, -2, -3]
    assert 1 <= proxy.accepted <= 4
    client.close()
    _wait_until(lambda: proxy.open == 0, "close() closed the pooled connections")


def test_aquery_reuses_connections_on_its_loop_and_the_loop_closes_them(proxy: Proxy) -> None:
    client = patchkit.Endpoint(proxy.url, lambda: None)

    async def main() -> list[Any]:
        answers = [await client.aquery(x=i) for i in range(20)]
        answers += await asyncio.gather(*(client.aquery(x=i) for i in range(10)))
        return answers

    assert asyncio.run(main()) == [-i for i in range(20)] + [-i for i in range(10)]
    assert proxy.accepted <= 10  # one reused for the 20 in turn, at most one per call of the 10 at once
    _wait_until(lambda: proxy.open == 0, "the end of asyncio.run closed the loop's connections")
    gc.collect()  # nothing left unclosed to warn about (warnings are errors)
    accepted = proxy.accepted
    assert asyncio.run(main()) == [-i for i in range(20)] + [-i for i in range(10)]  # a new loop, a new client
    assert proxy.accepted > accepted
    client.close()
    gc.collect()


def test_close_closes_the_connections_of_a_loop_that_still_runs(proxy: Proxy) -> None:
    client = patchkit.Endpoint(proxy.url, lambda: None)

    async def main() -> None:
        assert await client.aquery(x=2) == -2
        assert proxy.open == 1
        client.close()  # from the loop's own code: its client closes as the loop goes on
        await asyncio.to_thread(_wait_until, lambda: proxy.open == 0, "close() closed the loop's connection")

    asyncio.run(main())
    with pytest.raises(patchkit.PatchkitError, match="is closed"):
        client.query(x=1)


def test_errors_are_the_endpoints_through_both_clients(served: str) -> None:
    client = patchkit.Endpoint(served, lambda: None)
    with pytest.raises(patchkit.InputError, match="unknown pipeline input 'y'"):
        client.query(y=1)
    with pytest.raises(patchkit.InputError, match="unknown pipeline input 'y'"):
        asyncio.run(client.aquery(y=1))
    client.close()


def test_a_call_that_gets_no_answer_times_out() -> None:
    proxy = Proxy(None)  # takes the request and never answers
    client = patchkit.Endpoint(proxy.url, lambda: None, timeout_s=0.5)
    raised: list[BaseException] = []

    def call() -> None:
        try:
            client.query(x=1)
        except BaseException as exc:
            raised.append(exc)

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "query() waited for an answer without end"
    assert len(raised) == 1 and isinstance(raised[0], patchkit.DeadlineExceeded), raised
    assert "no answer from the endpoint" in str(raised[0])
    with pytest.raises(patchkit.DeadlineExceeded):
        asyncio.run(asyncio.wait_for(client.aquery(x=1), 60))
    client.close()
    proxy.close()
