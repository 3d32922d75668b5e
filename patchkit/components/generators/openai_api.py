"""`OpenAIGenerator`: a model behind any server speaking OpenAI's `/v1/chat/completions` (vLLM,
llama.cpp's server, llama-cpp-python's, Ollama), over aiohttp: each call streams its answer (server-
sent events), and the calls in flight together are sent together, for the servers that batch them
(vLLM; llama.cpp's server with --parallel)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import urllib.parse
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from patchkit.component import make
from patchkit.components.generators.background import BackgroundLoop
from patchkit.components.generators.base import DEFAULT_SYSTEM_PROMPT, Generator, Request
from patchkit.components.generators.streaming import stripped

if TYPE_CHECKING:
    import aiohttp

__all__ = ["OpenAIGenerator"]

logger = logging.getLogger(__name__)

MAX_CONCURRENCY = 64  # calls one replica takes at once; `max_concurrency` bounds those sent to the server

# How servers word a 400 for a prompt past the context: OpenAI and llama-cpp-python ("maximum context
# length", code context_length_exceeded), vLLM ("maximum context length", "maximum model length"),
# llama.cpp's server ("exceeds the available context size", type exceed_context_size_error).
CONTEXT_EXCEEDED = re.compile(r"context.(length|size|window)|maximum model length", re.IGNORECASE)


class OpenAIGenerator(Generator):
    """A chat model served by an OpenAI-compatible server, asked at `POST {base_url}/chat/completions`.

    `base_url`: the API root, such as "http://127.0.0.1:8080/v1". `model`: the name sent with every
    request (default: the first model the server lists, asked at `setup()`). `api_key`: sent as a
    bearer token (default: $OPENAI_API_KEY where the generator runs, read by `setup()` in each worker,
    else none); a constructor argument is recorded in the component's spec and travels to its workers
    (every repr shows it as '***'), so prefer the variable, which stays out of your code and the spec.
    `extra_body`: server-specific fields added to every request, as `{"repeat_penalty": 1.0}` for
    llama-cpp-python's server, whose default of 1.1 otherwise makes its answers differ from
    `LlamaCppGenerator`'s for the same model.

    `generate(prompt, docs=None, max_tokens=None)` answers one prompt in pipeline code, as every
    Generator, and streams it to a streaming request: it asks with `"stream": true` and yields each
    delta's content as it arrives. A replica takes up to 64 calls at once, each in a thread of its
    own, over one event loop thread and one HTTP session; at most `max_concurrency` requests are at
    the server at once, the others wait. Closing a stream early closes its HTTP response.
    llama-cpp-python's server cuts a streamed answer short when another request arrives unless it
    runs with `--interrupt_requests False`: start it so to send it calls together.
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        api_key: str | None = None,
        max_tokens: int = 96,
        temperature: float = 0.0,
        seed: int = 0,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        timeout_s: float = 60.0,
        max_concurrency: int = 16,
        extra_body: Mapping[str, Any] | None = None,
    ) -> None:
        if not _is_http_url(base_url):
            raise ValueError(
                f"base_url must be an http:// or https:// URL with a host and the API root, such as "
                f"'http://127.0.0.1:8080/v1'; got {base_url!r}"
            )
        if timeout_s <= 0:
            raise ValueError(f"timeout_s ({timeout_s}) must be > 0")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency ({max_concurrency}) must be >= 1")
        super().__init__(max_tokens=max_tokens, temperature=temperature, seed=seed, system_prompt=system_prompt)
        self.base_url, self.model, self.api_key = base_url.rstrip("/"), model, api_key
        self.timeout_s, self.max_concurrency, self.extra_body = timeout_s, max_concurrency, dict(extra_body or {})

    def setup(self) -> None:
        """Called once in the process that runs the generator, before its first call: starts the event loop
        thread and HTTP session every call shares, checks that the server answers (a ConnectionError
        naming the URL if not) and asks it for its model when none was given."""
        key = self.api_key or os.environ.get("OPENAI_API_KEY")  # here, in the worker: never in the spec
        self.loop = BackgroundLoop("patchkit-openai")
        self.http = self.loop.run(self._open(key))
        weakref.finalize(self, self.loop.close, self.http.close)
        listed = self.loop.run(self._list_models())
        if self.model is None:
            if not listed:
                raise RuntimeError(f"the server at {self.base_url} lists no models; pass OpenAIGenerator(model=...)")
            self.model = listed[0]
            logger.info("no model given: using %s, the first that %s lists", self.model, self.base_url)

    @make(stream=True, max_concurrency=MAX_CONCURRENCY, read_only=True)
    def generate(self, prompt: str, docs: list[Any] | None = None, max_tokens: int | None = None) -> Iterator[str]:  # type: ignore[override]
        """Stream the answer as the server sends it; called in a thread of its own for each call, and
        closing the stream closes its HTTP response (the server sees the client leave)."""
        request = self.request(prompt, docs, max_tokens)
        yield from stripped(self.loop.iterate(self._deltas(self._body(request))))

    def _body(self, request: Request) -> dict[str, Any]:
        return {
            **self.extra_body,
            "model": self.model,
            "messages": request.messages,
            **self.sampling.keywords(request.max_tokens),
        }

    async def _open(self, key: str | None) -> aiohttp.ClientSession:
        # On the loop: a session and a semaphore belong to the loop they are made on.
        import aiohttp

        self._gate = asyncio.Semaphore(self.max_concurrency)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def _list_models(self) -> list[str]:
        async with self._response("GET", "/models") as response:
            reply = await self._json(response)
        listed = reply.get("data") if isinstance(reply, dict) else None
        return [str(m["id"]) for m in listed or [] if isinstance(m, dict) and "id" in m]

    async def _deltas(self, body: dict[str, Any]) -> AsyncIterator[str]:
        """The content of each delta of one streamed chat completion, on the loop. A stream that breaks
        before its first delta is asked again whole: llama-cpp-python's server reports a prompt past the
        context only that way, by failing a stream it already answered 200 to."""
        url = self.base_url + "/chat/completions"
        async with self._gate:
            streamed = False
            try:
                async with self._response("POST", "/chat/completions", {**body, "stream": True}) as response:
                    if response.content_type != "text/event-stream":  # a server that does not stream: one answer
                        yield _message_content(url, await self._json(response))
                        return
                    async for line in response.content:
                        if (event := _event(url, line)) is _DONE:
                            return
                        if event:
                            streamed = True
                            yield event
                    response.close()  # the connection, which the server may be closing: never back to the pool
                raise ConnectionError(f"{url} ended its stream before its last event (data: [DONE])")
            except (ConnectionError, TimeoutError):
                if streamed:
                    raise
            # On a connection of its own: the one the stream broke on may still sit in the pool.
            async with self._one_off() as session, self._response("POST", "/chat/completions", body, session) as response:
                yield _message_content(url, await self._json(response))

    @contextlib.asynccontextmanager
    async def _response(
        self, method: str, path: str, body: Any = None, session: aiohttp.ClientSession | None = None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request's response, its status checked; any failure, reading the body included, as an error
        that says what to do about it."""
        import aiohttp

        url = self.base_url + path
        try:
            async with (session or self.http).request(method, url, json=body) as response:
                if response.status >= 400:
                    raise _http_error(url, response.status, await response.text(errors="replace"))
                yield response
        except TimeoutError as exc:
            raise TimeoutError(
                f"{url} did not answer within timeout_s ({self.timeout_s} s); raise timeout_s or lower max_tokens"
            ) from exc
        except aiohttp.ClientError as exc:
            raise ConnectionError(
                f"cannot reach the OpenAI-compatible server at {url}: {type(exc).__name__}: {exc}; "
                "start the server or fix base_url"
            ) from exc

    def _one_off(self) -> aiohttp.ClientSession:
        import aiohttp

        return aiohttp.ClientSession(headers=self.http.headers, timeout=self.http.timeout)

    @staticmethod
    async def _json(response: aiohttp.ClientResponse) -> Any:
        text = await response.text(errors="replace")
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise RuntimeError(
                f"{response.url} answered HTTP {response.status} with a body that is not JSON: {text[:200]!r}; base_url "
                "must be the root of an OpenAI-compatible API (it ends in /v1 on most servers)"
            ) from None


_DONE = "[DONE]"


def _event(url: str, line: bytes) -> str | None:
    """What one line of a chat completion's event stream carries: a delta's content, `_DONE` at the end,
    or None (a comment, a role-only or usage-only chunk, a blank line between events)."""
    text = line.decode("utf-8", errors="replace").strip()
    if not text.startswith("data:"):
        return None
    data = text[len("data:") :].strip()
    if data == _DONE:
        return _DONE
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        raise RuntimeError(f"{url} streamed an event that is not JSON: {data[:200]!r}") from None
    if isinstance(chunk, dict) and "error" in chunk:
        raise _stream_error(url, data)
    try:
        content = (chunk["choices"] or [{}])[0].get("delta", {}).get("content")
    except (KeyError, IndexError, TypeError, AttributeError):
        raise RuntimeError(f"{url} streamed a chunk without choices[0].delta: {data[:500]}") from None
    return str(content) if content else None


def _message_content(url: str, reply: Any) -> str:
    try:
        return str(reply["choices"][0]["message"]["content"] or "")
    except (KeyError, IndexError, TypeError):
        raise RuntimeError(f"{url} answered without choices[0].message: {reply!r:.500}") from None


def _is_http_url(url: Any) -> bool:
    if not isinstance(url, str):
        return False
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number from 0 to 65535
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def _http_error(url: str, status: int, text: str) -> Exception:
    """The exception for an HTTP error answer: a ValueError for a prompt past the context, else a RuntimeError."""
    message, code = _error_fields(text)
    if status == 400 and CONTEXT_EXCEEDED.search(f"{message} {code}"):
        return ValueError(
            f"{url} refused the prompt: {message.rstrip('. ')}; shorten the question or the documents, or lower max_tokens"
        )
    hint = {
        401: "; pass api_key= or set OPENAI_API_KEY",
        403: "; pass api_key= or set OPENAI_API_KEY",
        404: "; check base_url (the API root, which ends in /v1 on most servers) and model",
    }.get(status, "")
    return RuntimeError(f"{url} answered HTTP {status}: {text[:1000]}{hint}")


def _stream_error(url: str, text: str) -> Exception:
    """The exception for an error event inside a stream: a ValueError for a prompt past the context, else a RuntimeError."""
    message, code = _error_fields(text)
    if CONTEXT_EXCEEDED.search(f"{message} {code}"):
        return ValueError(
            f"{url} refused the prompt: {message.rstrip('. ')}; shorten the question or the documents, or lower max_tokens"
        )
    return RuntimeError(f"{url} sent an error in its stream: {message[:1000]}")


def _error_fields(text: str) -> tuple[str, str]:
    """(message, code) of an error body: OpenAI's {"error": {"message", "code", "type"}}, Ollama's {"error": "..."}."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return text, ""
    error = data.get("error", data) if isinstance(data, dict) else data
    if isinstance(error, dict):
        code = " ".join(str(error.get(k) or "") for k in ("code", "type"))
        return str(error.get("message") or error.get("detail") or text), code
    return str(error), ""
