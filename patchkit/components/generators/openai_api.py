"""`OpenAIGenerator`.

A model behind any server speaking OpenAI's `/v1/chat/completions` (vLLM, llama.cpp's server, llama-cpp-python's, Ollama), through
the `openai` package's `AsyncOpenAI`: each call streams its answer, as a coroutine on its replica's event loop, so that one
replica holds hundreds of calls in flight with no thread each, and the calls in flight together reach the server together, for the
servers that batch them (vLLM; llama.cpp's server with --parallel).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import re
import urllib.parse
import weakref
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from patchkit.components.generators.base import DEFAULT_SYSTEM_PROMPT, Generator, Request
from patchkit.components.generators.streaming import StrippedText
from patchkit.core import make
from patchkit.core.event_loop import CLOSE_TIMEOUT_S, component_loop
from patchkit.core.options import OPTIONS, CallOptions, CallReport

if TYPE_CHECKING:
    import openai

__all__ = ["OpenAIGenerator"]

logger = logging.getLogger(__name__)

MAX_CONCURRENCY = 512  # the most calls one replica takes at once, each a coroutine (see `batch_limit`)
# The call options sent as the request's own fields (max_tokens, temperature, top_p and seed with the
# generator's own settings), and those only vLLM-like servers take, in the extra body.
_PASSED = ("presence_penalty", "frequency_penalty", "response_format", "logprobs", "top_logprobs")
_EXTRA = ("ignore_eos", "min_tokens")
NO_KEY = "no-key"  # sent when no key is given: the client needs one, and a server that asks for none ignores it

# How servers word a 400 for a prompt past the context: OpenAI and llama-cpp-python ("maximum context
# length", code context_length_exceeded), vLLM ("maximum context length", "maximum model length"),
# llama.cpp's server ("exceeds the available context size", type exceed_context_size_error).
CONTEXT_EXCEEDED = re.compile(r"context.(length|size|window)|maximum model length", re.IGNORECASE)


class OpenAIGenerator(Generator):
    """A chat model served by an OpenAI-compatible server, asked at `POST {base_url}/chat/completions`.

    `generate(prompt, docs=None, max_tokens=None)` answers one prompt in pipeline code, as every
    Generator, and streams it to a streaming request: it asks with `"stream": true` and yields each
    delta's content as it arrives. It is an async generator on `AsyncOpenAI`: a replica takes up to
    8 x `max_concurrency` calls at once (128 by default, at most 512), each awaiting the server on the
    replica's event loop (no thread each), over one client and its connection pool; at most
    `max_concurrency` requests are at the server at once, the others wait. Closing a stream early, or
    cancelling its call (its request ended), closes its HTTP response. llama-cpp-python's server cuts
    a streamed answer short when another request arrives unless it runs with
    `--interrupt_requests False`: start it so to send it calls together.

    Args:
        base_url: the API root, such as "http://127.0.0.1:8080/v1".
        model: the name sent with every request (default: the first model the server lists, asked at
            `setup()`).
        api_key: sent as a bearer token (default: $OPENAI_API_KEY where the generator runs, read by
            `setup()` in each worker, else none). A constructor argument is recorded in the component's
            spec and travels to its workers (every repr shows it as '***'), so prefer the variable, which
            stays out of your code and the spec.
        max_tokens: the most tokens an answer takes unless its call says otherwise.
        temperature: 0 answers greedily; above it, answers are sampled.
        seed: the sampling generator's seed.
        system_prompt: the chat's system prompt (None: none).
        timeout_s: how long one request to the server may take.
        max_concurrency: the requests at the server at once, per replica.
        extra_body: server-specific fields added to every request, as `{"repeat_penalty": 1.0}` for
            llama-cpp-python's server, whose default of 1.1 otherwise makes its answers differ from
            `LlamaCppGenerator`'s for the same model.

    Raises:
        ValueError: a `base_url` that is not an http(s) URL, or a bound out of range.
    """

    client: openai.AsyncOpenAI  # made by setup(), on the loop the calls run on
    _gate: asyncio.Semaphore

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

    honoured_options = frozenset(OPTIONS)  # all of them go to the server, which answers for its own

    async def setup(self) -> None:
        """Called once in the process that runs the generator, before its first call, on the event loop its calls run on.

        Opens the client every call shares, checks that the server answers (a ConnectionError naming the URL if not) and asks it
        for its model when none was given.
        """
        try:
            import openai
        except ImportError:
            raise ImportError("OpenAIGenerator needs the openai package: pip install -e '.[openai]' in patchkit's "
                              "checkout") from None

        key = self.api_key or os.environ.get("OPENAI_API_KEY") or NO_KEY  # here, in the worker: never in the spec
        self.client = openai.AsyncOpenAI(base_url=self.base_url, api_key=key, timeout=self.timeout_s, max_retries=0)
        weakref.finalize(self, _close, self.client)
        self._gate = asyncio.Semaphore(self.max_concurrency)
        async with self._failures("/models"):
            listed = [str(m.id) async for m in self.client.models.list()]
        if self.model is None:
            if not listed:
                raise RuntimeError(f"the server at {self.base_url} lists no models; pass OpenAIGenerator(model=...)")
            self.model = listed[0]
            logger.info("no model given: using %s, the first that %s lists", self.model, self.base_url)

    @make(stream=True, max_concurrency=MAX_CONCURRENCY, read_only=True)
    async def generate(  # type: ignore[override]
        self, prompt: str, docs: list[Any] | None = None, max_tokens: int | None = None,
        options: CallOptions | None = None,
    ) -> AsyncIterator[str | CallReport]:
        """Stream the answer as the server sends it, on the replica's event loop, then its `CallReport`.

        `options` (where this call answers a request) go to the server as the request's own (ignore_eos and
        min_tokens in its extra body, as vLLM takes them); the report is the server's usage, finish_reason
        and logprobs. Stopping the stream (closing it, cancelling the call) closes its HTTP response, so the
        server sees the client leave.
        """
        request = self.request(prompt, docs, max_tokens, options)
        text = StrippedText()  # its chunks join to exactly the answer a call returns
        ending = _Ending()
        async with self._gate:
            async for delta in self._deltas(self._body(request), ending):
                if chunk := text.feed(delta):
                    yield chunk
        yield ending.report(request)

    def batch_limit(self, method: str) -> int:
        """Calls one replica takes at once.

        That is 8 for each request it sends the server at once (the others wait their turn at the replica, not at the
        front-end), at most MAX_CONCURRENCY; deploy()'s default and where the profiler's search starts.
        """
        super().batch_limit(method)  # a MakeError for a method that is not @make
        return min(MAX_CONCURRENCY, 8 * self.max_concurrency)

    def _body(self, request: Request) -> dict[str, Any]:
        """The chat completion request: this generator's settings, the call's options over them."""
        options = request.options
        sent = {name: getattr(options, name) for name in _PASSED if getattr(options, name) not in (None, False, ())}
        if options.stop:
            sent["stop"] = list(options.stop)
        extra = {**self.extra_body, **{name: getattr(options, name) for name in _EXTRA if getattr(options, name)}}
        return {"model": self.model, "messages": request.messages, "extra_body": extra,
                **self.sampling.applied(options).keywords(request.max_tokens), **sent}

    async def _deltas(self, body: dict[str, Any], ending: _Ending) -> AsyncIterator[str]:
        """The content of each delta of one streamed chat completion.

        A stream that breaks before its first delta, or ends without a finish reason, is asked again whole: llama-cpp-python's
        server reports a prompt past the context only that way, by failing a stream it already answered 200 to, and a server that
        does not stream answers once.
        """
        url = self.base_url + "/chat/completions"
        streamed = False
        try:
            async with self._failures("/chat/completions"):
                stream = await self.client.chat.completions.create(**body, stream=True,
                                                                   stream_options={"include_usage": True})
                async with stream:  # closes the response however the stream ends
                    finished = False
                    async for chunk in stream:
                        choice = chunk.choices[0] if chunk.choices else None
                        ending.read(chunk, choice)
                        finished = finished or bool(choice is not None and choice.finish_reason)
                        if choice is not None and choice.delta is not None and choice.delta.content:
                            streamed = True
                            yield choice.delta.content
                if not finished:
                    raise ConnectionError(f"{url} ended its stream before its last chunk (one with a finish_reason)")
            return
        except (ConnectionError, TimeoutError):
            if streamed:
                raise
        # On a connection of its own: the one the stream broke on may still sit in the pool.
        async with self._failures("/chat/completions"), self._one_off() as client:
            completion = await client.chat.completions.create(**body)
        if not completion.choices or completion.choices[0].message is None:
            raise RuntimeError(f"{url} answered without choices[0].message: {completion!r:.500}")
        ending.read(completion, completion.choices[0])
        yield completion.choices[0].message.content or ""

    def _one_off(self) -> openai.AsyncOpenAI:
        """A client of its own, as `setup()` makes one, for one request: closed by its `async with`."""
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.client.api_key, timeout=self.timeout_s, max_retries=0)

    @contextlib.asynccontextmanager
    async def _failures(self, path: str) -> AsyncIterator[None]:
        """The client's errors for a request to `path` (reading its stream included) as errors that say what to do about them.

        A ValueError for a prompt past the context, ConnectionError, TimeoutError, or a RuntimeError with the server's answer.
        """
        import openai

        url = self.base_url + path
        unreachable: tuple[type[Exception], ...] = (openai.APIConnectionError, *_transport_errors())
        try:
            yield
        except openai.APIStatusError as exc:
            raise _http_error(url, exc.status_code, exc.response.text) from None
        except openai.APITimeoutError as exc:
            raise TimeoutError(
                f"{url} did not answer within timeout_s ({self.timeout_s} s); raise timeout_s or lower max_tokens"
            ) from exc
        except unreachable as exc:
            raise ConnectionError(
                f"cannot reach the OpenAI-compatible server at {url}: {type(exc).__name__}: {exc}; "
                "start the server or fix base_url"
            ) from exc
        except openai.APIError as exc:  # an error event inside a stream
            raise _stream_error(url, json.dumps({"error": exc.body if exc.body is not None else exc.message})) from None


class _Ending:
    """What a server said of one answer as its chunks (or its whole completion) came: usage, finish_reason, logprobs."""

    def __init__(self) -> None:
        self.usage: Any = None
        self.finish_reason: str | None = None
        self.logprobs: list[dict[str, Any]] | None = None

    def read(self, chunk: Any, choice: Any) -> None:
        """One chunk (or the whole completion) and its first choice, if it has one."""
        if getattr(chunk, "usage", None) is not None:
            self.usage = chunk.usage
        if choice is None:
            return
        self.finish_reason = choice.finish_reason or self.finish_reason
        content = getattr(getattr(choice, "logprobs", None), "content", None)
        if content:
            self.logprobs = [*(self.logprobs or []), *(entry.model_dump() for entry in content)]

    def report(self, request: Request) -> CallReport:
        """The server's counts; an estimate (marked so) where it sent no usage."""
        finish = self.finish_reason if self.finish_reason in ("stop", "length") else "stop"
        if self.usage is None:
            return CallReport(0, 0, finish, self.logprobs, counted=False)
        return CallReport(int(self.usage.prompt_tokens or 0), int(self.usage.completion_tokens or 0), finish,
                          self.logprobs)


def _close(client: openai.AsyncOpenAI) -> None:
    """Close a collected generator's client (its pooled connections) on the loop it was used on.

    From another thread, wait for that up to CLOSE_TIMEOUT_S.
    """
    loop = component_loop()
    closing = loop.submit(client.close())
    if not loop.on_loop():
        with contextlib.suppress(Exception):
            closing.result(CLOSE_TIMEOUT_S)


def _transport_errors() -> tuple[type[Exception], ...]:
    """The transport errors of the HTTP library under `openai` (httpx, or its successor).

    The client raises them as they are when a stream breaks after its response began.
    """
    import openai

    library = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])
    found = getattr(library, "TransportError", None)
    return (found,) if isinstance(found, type) and issubclass(found, Exception) else ()


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
