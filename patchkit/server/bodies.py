"""The request bodies in flight, bounded in bytes: admission at the edge, before a body is even read.

The HTTP layer counts each body from when its size is known (its Content-Length, then its decoded
size) until its request ends, so that the front-end never holds `max_inflight_requests x
max_body_bytes`: past `max_inflight_bytes` a request is refused with 503 and Retry-After.
"""

from __future__ import annotations

from collections.abc import Callable

from patchkit.errors import Overloaded

__all__ = ["BodyBudget"]


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
