"""An agent's view of a deployment: its pipelines as MCP tools, asked through the `mcp` SDK's client.

The pipeline looks a question up in a few notes and answers from the best one: two small pure-Python
components, so it runs anywhere in a second. `python examples/mcp_client.py` deploys it and talks to its
`/mcp` route as a hosted agent would: it lists the tools (each pipeline's name, description and input
schema), calls the pipeline's tool with a progress callback (each component call is a step), and prints the
answer. Given a URL (`python examples/mcp_client.py http://host:8000/mcp`) it asks that deployment instead,
with the token in PATCHKIT_AUTH_TOKEN when the deployment has one. Needs the `mcp` extra (`pip install -e '.[mcp]'`).
"""

from __future__ import annotations

import asyncio
import os
import sys

import patchkit
from patchkit import Component, make

NOTES = {
    "generator": "A generator function yields its values one at a time, as they are asked for.",
    "decorator": "A decorator takes a function and returns a new one that wraps it.",
    "context manager": "A with statement runs a context manager's exit code however its block ends.",
}


class NoteSearch(Component):
    """Ranks the notes by the words they share with the question."""

    @make(read_only=True)
    def search(self, question: str) -> list[str]:
        words = set(question.lower().replace("?", "").split())
        ranked = sorted(NOTES, key=lambda topic: -len(words & set(f"{topic} {NOTES[topic]}".lower().split())))
        return [NOTES[topic] for topic in ranked[:2]]


class Answerer(Component):
    """Answers with the best note."""

    @make
    def answer(self, question: str, notes: list[str]) -> str:
        return f"{notes[0]} (asked: {question})"


search, answerer = NoteSearch(), Answerer()
question = "What does a generator do?"
with patchkit.capture(run=False) as pipeline:
    notes = search.search(question)
    reply = {"answer": answerer.answer(question, notes), "notes": notes}


async def ask(url: str, token: str | None) -> None:
    """List the tools of the MCP server at `url` and call the first one, printing its progress and answer."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http:
        async with Client(streamable_http_client(url, http_client=http)) as client:
            tools = (await client.list_tools()).tools
            for tool in tools:
                print(f"tool {tool.name}: {tool.description}")
                print(f"  inputs: {tool.input_schema['properties']}")

            async def progress(done: float, total: float | None, message: str | None) -> None:
                print(f"  step {done:g}: {message}")

            result = await client.call_tool(tools[0].name, {"question": question}, progress_callback=progress)
            print("error:" if result.is_error else "answer:", result.structured_content or result.content[0])


def main(url: str | None = None) -> None:
    """Ask `url`'s tools, or those of this file's pipeline deployed for the occasion."""
    if url is not None:
        asyncio.run(ask(url, os.environ.get("PATCHKIT_AUTH_TOKEN")))
        return
    with patchkit.deploy({"notes": pipeline}, backend="inprocess") as endpoint:  # in this process: starts in a blink
        asyncio.run(ask(endpoint.url + "/mcp", None))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
