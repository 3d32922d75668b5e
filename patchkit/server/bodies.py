"""Request bodies at the edge: read bounded in size and time, decoded, and counted in flight.

The HTTP layer (`http.read_body`) refuses a body whose Content-Length is over `max_body_bytes` before reading
it (`announced_size`), reads it within `read_timeout_s` (`read_within`), undoes its Content-Encoding bounded by
the same limit (`decode`), and counts it from when its size is known (its Content-Length, then its decoded
size) until its request ends (`BodyBudget`), so that the front-end never holds `max_inflight_requests x
max_body_bytes`: past `max_inflight_bytes` a request is refused with 503 and Retry-After. The refusals are
aiohttp's HTTP errors (408, 413, 415), which the edge answers as JSON errors.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from patchkit.errors import InputError, Overloaded

__all__ = ["BodyBudget", "announced_size", "decode", "read_within", "too_large"]

_DECODERS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


class BodyBudget:
    """Bytes of request bodies in flight, at most `limit`. `on_refused(error)`: called with each refusal,
    which the front-end counts as that request's outcome. On the server's event loop."""

    def __init__(self, limit: int, on_refused: Callable[[Overloaded], None]) -> None:
        self.limit = limit
        self.held = 0
        self._on_refused = on_refused

    def hold(self, size: int, held: int = 0) -> int:
        """Count a body of `size` bytes in flight, in place of the `held` bytes counted for it so far;
        returns `size`, to be given back to `release` when its request ends. Raises Overloaded when it
        would take the bytes in flight past the limit."""
        grow = size - held
        if grow > 0 and self.held + grow > self.limit:
            error = Overloaded(self.held, self.limit, f"request bodies in flight hold {self.held} bytes; this one's "
                               f"{size} would pass max_inflight_bytes ({self.limit}); retry later")
            self._on_refused(error)
            raise error
        self.held += grow
        return size

    def release(self, held: int) -> None:
        """The request that `hold` counted `held` bytes for has ended."""
        self.held -= held


def too_large(limit: int, size: int, decoded: str = "") -> web.HTTPRequestEntityTooLarge:
    return web.HTTPRequestEntityTooLarge(limit, size, text=f"the body is over the limit of {limit} bytes{decoded}")


def announced_size(request: web.Request, limit: int) -> int:
    """The body's Content-Length (0 when it has none): over the limit, refused before it is read."""
    size = request.content_length or 0
    if size > limit:
        raise too_large(limit, size)
    return size


async def read_within(request: web.Request, timeout_s: float, limit: int) -> bytes:
    """The body as sent, within `timeout_s` of its headers."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.read()
    except TimeoutError:
        raise web.HTTPRequestTimeout(text=f"the body did not arrive within read_timeout_s ({timeout_s:g} s)") from None
    except web.HTTPRequestEntityTooLarge:
        raise too_large(limit, limit + 1) from None
    except RequestPayloadError as exc:
        raise InputError(f"the body could not be read: {' '.join(str(exc).split())}") from None


def decode(request: web.Request, body: bytes, limit: int) -> bytes:
    """Undo the body's Content-Encoding (gzip, deflate, identity), bounded by the body limit once decoded."""
    codings = [c.strip().lower() for c in request.headers.get("Content-Encoding", "").split(",") if c.strip()]
    for coding in reversed(codings):  # the last one listed was applied last
        if coding == "identity":
            continue
        if coding not in _DECODERS:
            raise web.HTTPUnsupportedMediaType(text=f"Content-Encoding {coding!r} is not supported: send the body "
                                               "as it is, or gzip or deflate it")
        decompressor = zlib.decompressobj(_DECODERS[coding])
        try:
            body = decompressor.decompress(body, limit + 1)
        except zlib.error as exc:
            raise InputError(f"the body is not {coding} data, as its Content-Encoding says ({exc})") from None
        if len(body) > limit:
            raise too_large(limit, len(body), " once decoded")
        if not decompressor.eof:
            raise InputError(f"the body's {coding} data is cut short")
    return body
