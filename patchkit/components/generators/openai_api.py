"""`OpenAIGenerator`: a model behind any server speaking OpenAI's `/v1/chat/completions` (vLLM,
llama.cpp's server, llama-cpp-python's, Ollama), over aiohttp: a batch's requests are in flight
together, for the servers that batch them (vLLM; llama.cpp's server with --parallel)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import urllib.parse
from collections.abc import Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from patchkit.component import make
from patchkit.components.generators.base import DEFAULT_SYSTEM_PROMPT, Generator, Request

if TYPE_CHECKING:
    import aiohttp

__all__ = ["OpenAIGenerator"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

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
    Generator; a deployment sends a batch's prompts together, at most `max_concurrency` at once.
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
        """Called once in the process that runs the generator, before its first call: checks that the
        server answers (a ConnectionError naming the URL if not) and asks it for its model when none was given."""
        key = self.api_key or os.environ.get("OPENAI_API_KEY")  # here, in the worker: never in the spec
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        listed = self._run(self._list_models())
        if self.model is None:
            if not listed:
                raise RuntimeError(f"the server at {self.base_url} lists no models; pass OpenAIGenerator(model=...)")
            self.model = listed[0]
            logger.info("no model given: using %s, the first that %s lists", self.model, self.base_url)

    @make(batch=True, max_batch_size=16)
    def generate(  # type: ignore[override]
        self, prompt: list[str], docs: list[list[Any] | None] = None, max_tokens: list[int | None] = None  # type: ignore[assignment]
    ) -> list[str]:
        # Any failed request fails the whole batch (see `Generator.requests`), not only a prompt past the context.
        requests = self.requests(prompt, docs, max_tokens)
        return self._run(self._complete_all([self._body(request) for request in requests]))

    def _body(self, request: Request) -> dict[str, Any]:
        return {
            **self.extra_body,
            "model": self.model,
            "messages": request.messages,
            **self.sampling.keywords(request.max_tokens),
        }

    @staticmethod
    def _run(coroutine: Coroutine[Any, Any, T]) -> T:
        # On a fresh event loop in a thread of its own: the caller may be running one already (the
        # inprocess backend runs batches on its front-end's loop, Jupyter runs cells on the kernel's).
        with ThreadPoolExecutor(1, thread_name_prefix="patchkit-openai") as pool:
            return pool.submit(asyncio.run, coroutine).result()

    def _session(self) -> aiohttp.ClientSession:
        import aiohttp

        return aiohttp.ClientSession(headers=self._headers, timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def _list_models(self) -> list[str]:
        async with self._session() as session:
            reply = await self._request(session, "GET", "/models")
        listed = reply.get("data") if isinstance(reply, dict) else None
        return [str(m["id"]) for m in listed or [] if isinstance(m, dict) and "id" in m]

    async def _complete_all(self, bodies: list[dict[str, Any]]) -> list[str]:
        gate = asyncio.Semaphore(self.max_concurrency)
        async with self._session() as session:

            async def complete(body: dict[str, Any]) -> str:
                async with gate:
                    reply = await self._request(session, "POST", "/chat/completions", body)
                try:
                    answer = reply["choices"][0]["message"]["content"] or ""
                except (KeyError, IndexError, TypeError):
                    url = self.base_url + "/chat/completions"
                    raise RuntimeError(f"{url} answered without choices[0].message: {reply!r:.500}") from None
                return str(answer).strip()

            tasks = [asyncio.create_task(complete(body)) for body in bodies]
            try:
                return list(await asyncio.gather(*tasks))
            finally:
                # After a failure the batch is re-run call by call anyway: stop the calls still in flight.
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _request(self, session: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> Any:
        """One request: the server's JSON answer, or an error that says what to do about it."""
        import aiohttp

        url = self.base_url + path
        try:
            async with session.request(method, url, json=body) as response:
                status, text = response.status, await response.text(errors="replace")
        except TimeoutError as exc:
            raise TimeoutError(
                f"{url} did not answer within timeout_s ({self.timeout_s} s); raise timeout_s or lower max_tokens"
            ) from exc
        except aiohttp.ClientError as exc:
            raise ConnectionError(
                f"cannot reach the OpenAI-compatible server at {url}: {type(exc).__name__}: {exc}; "
                "start the server or fix base_url"
            ) from exc
        if status >= 400:
            raise _http_error(url, status, text)
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise RuntimeError(
                f"{url} answered HTTP {status} with a body that is not JSON: {text[:200]!r}; base_url must be the "
                "root of an OpenAI-compatible API (it ends in /v1 on most servers)"
            ) from None


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
