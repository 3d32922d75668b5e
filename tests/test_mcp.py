"""Served pipelines as MCP tools, through the official `mcp` client: over Streamable HTTP at `/mcp` (in both
protocol eras: the 2026 per-request one the client picks by default, and the handshake one older clients
speak) and over stdin/stdout (`patchkit mcp`). A tool per pipeline, described and typed by it; a call
answers what `POST /v1/query` answers; bad arguments and pipeline errors are tool errors; a cancelled call
cancels its query; an update reaches the client as `notifications/tools/list_changed`; the token guards /mcp."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_deploy_local import _children

pytest.importorskip("mcp", reason="the MCP tools need the mcp package: pip install -e '.[mcp]'")

import anyio  # noqa: E402
import httpx2  # noqa: E402
import mcp_types as types  # noqa: E402
from mcp import Client  # noqa: E402
from mcp.client.stdio import StdioServerParameters, stdio_client  # noqa: E402
from mcp.client.streamable_http import streamable_http_client  # noqa: E402

import patchkit  # noqa: E402
from patchkit import Component, make  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "mcp-test-token"
MODES = ["auto", "legacy"]  # the 2026 era (the client's default), and the handshake era


class Notes(Component):
    """Finds notes about a question; refuses one holding "boom"."""

    @make(read_only=True)
    def search(self, question: str) -> list[str]:
        if "boom" in question:
            raise ValueError(f"cannot search for {question!r}")
        return [f"a note about {question}", "the tutorial"]


class Writer(Component):
    @make
    def write(self, question: str, notes: list[str], words: int) -> str:
        return " ".join(f"{question} -> {notes[0]}".split()[:words])


class Napper(Component):
    """Awaits as long as asked, counting the naps started and those cancelled where they awaited."""

    def setup(self) -> None:
        self.started = self.cancelled = 0

    @make(max_concurrency=8)
    async def nap(self, seconds: float) -> str:
        self.started += 1
        try:
            await asyncio.sleep(seconds)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return "woke"

    def stats(self) -> dict[str, Any]:
        return {"started": self.started, "cancelled": self.cancelled}


notes, writer, napper = Notes(), Writer(), Napper()


def answer() -> patchkit.Pipeline:
    """Answer a question from the notes, with the notes it used."""
    question = "What is a generator?"
    words = 8
    with patchkit.capture(run=False) as pipeline:
        found = notes.search(question)
        return {"answer": writer.write(question, found, words), "sources": found}  # type: ignore[return-value]
    return pipeline


def answer_briefly() -> patchkit.Pipeline:
    """Answer a question from the notes in a few words."""
    question = "What is a generator?"
    words = 3
    with patchkit.capture(run=False) as pipeline:
        found = notes.search(question)
        return {"answer": writer.write(question, found, words), "sources": found}  # type: ignore[return-value]
    return pipeline


def napping() -> patchkit.Pipeline:
    seconds = 0.0
    with patchkit.capture(run=False) as pipeline:
        return napper.nap(seconds)  # type: ignore[no-any-return]
    return pipeline


@pytest.fixture(scope="module")
def endpoint() -> Iterator[patchkit.Endpoint]:
    with patchkit.deploy({"answer": answer(), "nap": napping()}, backend="inprocess", auth_token=TOKEN) as served:
        yield served


@asynccontextmanager
async def http_client(endpoint: patchkit.Endpoint, mode: str = "auto", headers: dict[str, str] | None = None,
                      **options: Any) -> AsyncIterator[Client]:
    """The SDK's client of the deployment's `/mcp`, with its token (and `headers`), in `mode` ("auto": the 2026 era)."""
    headers = {"Authorization": f"Bearer {TOKEN}", **(headers or {})}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http:
        async with Client(streamable_http_client(endpoint.url + "/mcp", http_client=http), mode=mode, **options) as client:
            yield client


def run(coroutine: Any) -> Any:
    return anyio.run(lambda: coroutine)


def query(endpoint: patchkit.Endpoint, name: str, inputs: dict[str, Any]) -> Any:
    reply = httpx.post(f"{endpoint.url}/v1/pipelines/{name}/query", json={"inputs": inputs},
                       headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["output"]


@pytest.mark.parametrize("mode", MODES)
def test_each_pipeline_is_a_tool_named_described_and_typed_by_it(endpoint: patchkit.Endpoint, mode: str) -> None:
    async def listed() -> list[types.Tool]:
        async with http_client(endpoint, mode) as client:
            return (await client.list_tools()).tools

    tools = {tool.name: tool for tool in run(listed())}
    assert set(tools) == {"answer", "nap"}
    assert tools["answer"].description == "Answer a question from the notes, with the notes it used."
    assert tools["answer"].input_schema == {
        "type": "object", "properties": {"question": {"type": "string"}, "words": {"type": "integer"}},
        "required": ["question", "words"], "additionalProperties": False}
    assert tools["answer"].output_schema is not None
    assert set(tools["answer"].output_schema["properties"]) == {"answer", "sources"}
    # a pipeline without a docstring: what its graph calls and returns
    assert tools["nap"].description is not None and "napper.nap" in tools["nap"].description
    assert tools["nap"].input_schema["properties"] == {"seconds": {"type": "number"}}
    assert tools["nap"].output_schema is None  # a str output: text only


@pytest.mark.parametrize("mode", MODES)
def test_a_call_answers_what_the_query_route_answers(endpoint: patchkit.Endpoint, mode: str) -> None:
    inputs = {"question": "What does yield do?", "words": 5}

    async def called() -> tuple[types.CallToolResult, types.CallToolResult]:
        async with http_client(endpoint, mode, {"X-Request-ID": f"mcp-{mode}"}) as client:
            return await client.call_tool("answer", inputs), await client.call_tool("nap", {"seconds": 0.01})

    structured, text = run(called())
    expected = query(endpoint, "answer", inputs)
    assert not structured.is_error and structured.structured_content == expected
    assert isinstance(structured.content[0], types.TextContent)
    assert json.loads(structured.content[0].text) == expected  # and as JSON text, for clients that read text only
    assert structured.meta is not None and structured.meta["patchkit/request_id"] == f"mcp-{mode}"  # the client's id
    assert not text.is_error and text.content == [types.TextContent(text="woke")]  # a str output, as it is


@pytest.mark.parametrize("mode", MODES)
def test_a_bad_argument_is_a_tool_error_naming_it_and_the_next_call_answers(endpoint: patchkit.Endpoint,
                                                                            mode: str) -> None:
    async def called() -> list[types.CallToolResult]:
        async with http_client(endpoint, mode) as client:
            return [await client.call_tool("answer", {"question": "q", "words": "five"}),
                    await client.call_tool("answer", {"question": "q"}),
                    await client.call_tool("answer", {"question": "q", "words": 3})]

    wrong, missing, right = run(called())
    assert wrong.is_error and "input 'words' must be an integer" in wrong.content[0].text  # type: ignore[union-attr]
    assert missing.is_error and "missing input 'words'" in missing.content[0].text  # type: ignore[union-attr]
    assert not right.is_error and right.structured_content == query(endpoint, "answer", {"question": "q", "words": 3})


def test_a_pipelines_error_is_a_tool_error_with_its_message_and_no_traceback(endpoint: patchkit.Endpoint) -> None:
    async def called() -> types.CallToolResult:
        async with http_client(endpoint) as client:
            return await client.call_tool("answer", {"question": "boom", "words": 3})

    failed = run(called())
    assert failed.is_error
    text = failed.content[0].text  # type: ignore[union-attr]
    assert "notes.search raised: ValueError: cannot search for 'boom'" in text
    assert "Traceback" not in text and "File " not in text


@pytest.mark.parametrize("mode", MODES)
def test_a_call_reports_its_steps_as_progress(endpoint: patchkit.Endpoint, mode: str) -> None:
    seen: list[tuple[float, str | None]] = []

    async def progress(done: float, total: float | None, message: str | None) -> None:
        seen.append((done, message))

    async def called() -> types.CallToolResult:
        async with http_client(endpoint, mode) as client:
            return await client.call_tool("answer", {"question": "q", "words": 3}, progress_callback=progress)

    assert not run(called()).is_error
    assert [done for done, _ in seen] == [1, 2, 3, 4]
    messages = [message or "" for _, message in seen]
    assert messages[0] == "notes.search started" and messages[2] == "writer.write started"
    assert messages[1].startswith("notes.search done in ") and messages[3].startswith("writer.write done in ")


@pytest.mark.parametrize("mode", MODES)
def test_a_cancelled_call_cancels_its_query(endpoint: patchkit.Endpoint, mode: str) -> None:
    before = endpoint.stats()

    async def give_up() -> None:
        async with http_client(endpoint, mode) as client:
            with anyio.move_on_after(1.0):
                await client.call_tool("nap", {"seconds": 120.0})
            assert (await client.call_tool("nap", {"seconds": 0.01})).content[0].text == "woke"  # type: ignore[union-attr]

    run(give_up())
    stats = endpoint.stats()
    cancelled = stats["requests"].get("cancelled", 0) - before["requests"].get("cancelled", 0)
    [report] = [r for r in stats["replica_reports"].values() if r["component_stats"].get("started")]
    assert cancelled == 1  # counted as a client that went away is
    assert report["component_stats"]["cancelled"] == 1 + sum(  # and the nap was cancelled where it awaited
        r["component_stats"].get("cancelled", 0) for r in before["replica_reports"].values())


def test_an_update_reaches_listening_clients_as_list_changed(endpoint: patchkit.Endpoint) -> None:
    legacy_heard = anyio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, types.ServerNotification) and message.method == "notifications/tools/list_changed":
            legacy_heard.set()

    async def listen() -> tuple[list[str], list[str]]:
        async with http_client(endpoint) as modern, http_client(endpoint, "legacy", message_handler=on_message) as legacy:
            assert legacy.server_capabilities.tools is not None and legacy.server_capabilities.tools.list_changed
            await legacy.list_tools()
            async with modern.listen(tools_list_changed=True) as events:
                await anyio.to_thread.run_sync(lambda: endpoint.update({"answer": answer_briefly()}))
                with anyio.fail_after(20):
                    event = await events.__anext__()
                    await legacy_heard.wait()
            assert type(event).__name__ == "ToolsListChanged"
            await anyio.to_thread.run_sync(lambda: endpoint.update({"extra": napping()}))
            return ([t.name for t in (await modern.list_tools()).tools], [t.name for t in (await legacy.list_tools()).tools])

    modern_tools, legacy_tools = run(listen())
    assert sorted(modern_tools) == sorted(legacy_tools) == ["answer", "extra", "nap"]


def test_mcp_takes_the_deployments_token(endpoint: patchkit.Endpoint) -> None:
    refused = httpx.post(endpoint.url + "/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
                         headers={"Accept": "application/json, text/event-stream"}, timeout=30)
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "Unauthorized"

    async def unauthorized() -> None:
        async with Client(endpoint.url + "/mcp") as client:
            await client.list_tools()

    with pytest.raises(Exception):  # noqa: B017 - the SDK's error for a 401 varies by era
        run(unauthorized())

    async def authorized() -> list[str]:
        async with http_client(endpoint) as client:
            return [tool.name for tool in (await client.list_tools()).tools]

    assert "answer" in run(authorized())


APP = '''\
import os
import patchkit
from patchkit import Component, make

print("loading the app")  # a script's print must not reach the client


class Shout(Component):
    @make
    def shout(self, text: str) -> dict:
        print("shouting", text, flush=True)  # nor a worker's
        return {"text": text.upper(), "pid": os.getpid()}


shout = Shout()


def shouting():
    """Shout the text back."""
    text = "hi"
    with patchkit.capture(run=False) as pipeline:
        return shout.shout(text)
    return pipeline


pipeline = shouting()
'''


@asynccontextmanager
async def stdio(cwd: Path, log: Path, *arguments: str) -> AsyncIterator[Client]:
    """`patchkit mcp ARGUMENTS` started by the client, as a desktop client starts it; its stderr to `log`."""
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    params = StdioServerParameters(command=sys.executable, args=["-m", "patchkit.cli", "mcp", *arguments],
                                   cwd=str(cwd), env=env)
    strays: list[Exception] = []

    async def on_message(message: Any) -> None:
        if isinstance(message, Exception):  # a line on stdout that is no protocol message
            strays.append(message)

    with log.open("w") as errlog:
        async with Client(stdio_client(params, errlog=errlog), message_handler=on_message) as client:
            yield client
    assert strays == []


def test_patchkit_mcp_serves_over_stdio_and_stops_its_workers_when_stdin_closes(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(APP)
    log = tmp_path / "mcp.log"

    async def session() -> tuple[list[types.Tool], list[dict[str, Any]]]:
        async with stdio(tmp_path, log, "app=app.py", "--backend", "local", "--reload") as client:
            tools = (await client.list_tools()).tools
            first = await client.call_tool("app", {"text": "hello"})
            async with client.listen(tools_list_changed=True) as events:
                (tmp_path / "app.py").write_text(APP.replace("text.upper()", 'text.upper() + "!"'))  # an edit
                with anyio.fail_after(60):
                    await events.__anext__()  # --reload served it as the next version
            second = await client.call_tool("app", {"text": "hello"})
            return tools, [json.loads(called.content[0].text) for called in (first, second)]  # type: ignore[union-attr]

    tools, outputs = run(session())
    assert [(tool.name, tool.description) for tool in tools] == [("app", "Shout the text back.")]
    assert [output["text"] for output in outputs] == ["HELLO", "HELLO!"]
    text = log.read_text()
    assert "loading the app" in text and "shouting hello" in text  # on stderr, not on the client's stdout
    assert text.rstrip().endswith("stopped"), text[-2000:]  # it ended by itself once stdin closed
    for worker in {output["pid"] for output in outputs}:  # and its workers, the old version's and the new one's
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)


def test_patchkit_mcp_drains_and_stops_its_workers_on_sigterm_with_stdin_still_open(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(APP)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    log = tmp_path / "mcp.log"
    with log.open("w") as errlog:
        server = subprocess.Popen([sys.executable, "-m", "patchkit.cli", "mcp", "app.py", "--backend", "local"],
                                  cwd=tmp_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errlog)
    try:
        deadline = time.monotonic() + 60
        while "serving app.py as MCP tools" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [child for child in _children(server.pid) if child != server.pid]
        assert workers, log.read_text()[-2000:]
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0, log.read_text()[-2000:]  # stdin is still open: the signal ended it
    finally:
        server.kill()
        server.communicate()
    text = log.read_text()
    assert "SIGTERM arrived: draining" in text and text.rstrip().endswith("stopped"), text[-2000:]
    for worker in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(worker, 0)


def test_patchkit_mcp_refuses_a_port_it_would_not_listen_on(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(APP)
    done = subprocess.run([sys.executable, "-m", "patchkit.cli", "mcp", "app.py", "--port", "8123"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    assert done.returncode != 0 and done.stdout == ""
    assert "--port do nothing" in done.stderr and "patchkit serve" in done.stderr


def test_the_mcp_client_example_lists_the_tools_and_calls_one() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "mcp_client.py")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tool notes: Runs the notes pipeline: calls search.search, answerer.answer" in done.stdout
    assert "  step 4: answerer.answer done in " in done.stdout
    assert "answer: {'answer': 'A generator function yields its values" in done.stdout


def test_without_the_mcp_package_the_route_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    with patchkit.deploy(napping(), backend="inprocess") as fresh:  # its MCP server not started yet
        monkeypatch.setitem(sys.modules, "mcp.server.streamable_http_manager", None)  # as if not installed
        body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
        accept = {"Accept": "application/json, text/event-stream"}
        missing = httpx.post(fresh.url + "/mcp", json=body, headers=accept, timeout=30)
        monkeypatch.undo()

        async def listed() -> list[str]:
            async with Client(fresh.url + "/mcp") as client:
                return [tool.name for tool in (await client.list_tools()).tools]

        after = run(listed())
    assert missing.status_code == 501 and "pip install -e '.[mcp]'" in missing.json()["error"]["message"]
    assert after == ["patchkit"]  # once installed, the next request starts it
