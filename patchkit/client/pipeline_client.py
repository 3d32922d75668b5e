"""`PipelineClient`: one pipeline of an endpoint (`endpoint[name]`), served over HTTP."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, overload
from urllib.parse import quote

from patchkit.client.streams import AsyncStream, Step, Stream

if TYPE_CHECKING:
    from patchkit.client.endpoint import Endpoint

__all__ = ["PipelineClient"]


class PipelineClient:
    """One pipeline of an endpoint (`endpoint[name]`): its requests go to `POST /v1/pipelines/{name}/query`.

    Args:
        endpoint: the endpoint that serves it.
        name: the pipeline's name.
    """

    def __init__(self, endpoint: Endpoint, name: str) -> None:
        self.endpoint, self.name = endpoint, name
        self._path = f"/v1/pipelines/{quote(name, safe='')}/query"

    def query(self, **inputs: Any) -> Any:
        """As `Endpoint.query`, on this pipeline."""
        return self.endpoint._query(self._path, inputs)

    async def aquery(self, **inputs: Any) -> Any:
        """As `Endpoint.aquery`, on this pipeline."""
        return await self.endpoint._aquery(self._path, inputs)

    @overload
    def stream(self, *, steps: Literal[False] = False, **inputs: Any) -> Stream: ...
    @overload
    def stream(self, *, steps: Literal[True], **inputs: Any) -> Stream[str | Step]: ...
    def stream(self, *, steps: bool = False, **inputs: Any) -> Stream[Any]:
        """As `Endpoint.stream`, on this pipeline."""
        return self.endpoint._stream(self._path, inputs, steps)

    @overload
    def astream(self, *, steps: Literal[False] = False, **inputs: Any) -> AsyncStream: ...
    @overload
    def astream(self, *, steps: Literal[True], **inputs: Any) -> AsyncStream[str | Step]: ...
    def astream(self, *, steps: bool = False, **inputs: Any) -> AsyncStream[Any]:
        """As `Endpoint.astream`, on this pipeline."""
        return self.endpoint._astream(self._path, inputs, steps)

    def readiness(self) -> dict[str, Any]:
        """As `Endpoint.readiness`, of this pipeline: what `GET /v1/pipelines/{name}/readyz` answers, ready or not."""
        return self.endpoint.readiness(self.name)

    def __repr__(self) -> str:
        return f"<PipelineClient {self.name!r} of {self.endpoint.url}>"
