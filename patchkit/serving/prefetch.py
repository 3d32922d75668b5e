"""Lookahead prefetch inserted by the front-end (TeleRAG): find, in the captured graph, retriever
calls whose query is another call's result, and when that call starts, send the retriever a
`prefetch` of that call's input, so the retriever copies the clusters the coming query will
probably need while the upstream call (a generator rewriting the query) still runs.

`find_routes` is the pure graph pass; `Prefetcher` is the small runtime part the front-end's call
hook consults for every call.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from patchkit.capture.graph import Graph
from patchkit.core import CallSite, Component, MakeMethod

__all__ = ["PREFETCH_METHOD", "PrefetchRoute", "Prefetcher", "find_routes"]

logger = logging.getLogger(__name__)

PREFETCH_METHOD = "prefetch"


@dataclass(frozen=True)
class PrefetchRoute:
    """When the call at `site` (component `source_uid`, method `source_method`) starts, prefetch its
    input on component `target` (uid `target_uid`)."""

    site: CallSite
    source_uid: str
    source_method: str
    target: str
    target_uid: str


def has_prefetch(component: Component) -> bool:
    return isinstance(getattr(type(component), PREFETCH_METHOD, None), MakeMethod)


def find_routes(graph: Graph) -> list[PrefetchRoute]:
    """Every data edge from a call of one component into a call of another that has a `@make`
    `prefetch` method: the upstream call's input predicts the downstream call's query."""
    components = {name: c for name, c in graph.components().items()}
    routes: dict[tuple[CallSite, str], PrefetchRoute] = {}
    for edge in graph.edges:
        src, dst = graph.nodes.get(edge.src), graph.nodes.get(edge.dst)
        if edge.kind != "data" or src is None or dst is None or dst.method == PREFETCH_METHOD:
            continue
        target, source = components.get(dst.component), components.get(src.component)
        if target is None or source is None or target is source or not has_prefetch(target):
            continue
        route = PrefetchRoute(src.site, source._patchkit_spec.uid, src.method, dst.component, target._patchkit_spec.uid)
        routes.setdefault((src.site, route.target_uid), route)
    return list(routes.values())


class Prefetcher:
    """Issues the prefetches the routes call for; counts what happened to them for /metrics and stats()."""

    def __init__(self, routes: list[PrefetchRoute], submit: Callable[[str, tuple[Any, ...]], asyncio.Future[Any]]) -> None:
        self.routes: list[PrefetchRoute] = []
        self._submit = submit  # (target uid, args) -> the outcome future of a queued prefetch call
        self._by_site: dict[CallSite, list[PrefetchRoute]] = {}
        self._by_method: dict[tuple[str, str], list[PrefetchRoute]] = {}
        self.sources: frozenset[tuple[str, str]] = frozenset()  # the (component uid, method) calls that may start one
        self.add_routes(routes)
        self.counts: Counter[str] = Counter()  # issued, done, failed, skipped
        self.bytes_requested = 0
        self._tasks: set[asyncio.Future[Any]] = set()

    def add_routes(self, routes: list[PrefetchRoute]) -> None:
        """Take the routes of a pipeline deployed (its components' uids the deployed ones'); those known are kept once."""
        for route in routes:
            if route in self.routes:
                continue
            self.routes.append(route)
            self._by_site.setdefault(route.site, []).append(route)
            self._by_method.setdefault((route.source_uid, route.source_method), []).append(route)
        self.sources = frozenset(self._by_method)

    def drop_routes(self, uid: str) -> None:
        """Forget the routes from or to component `uid`, which left the deployment."""
        self.remove_routes([r for r in self.routes if uid in (r.source_uid, r.target_uid)])

    def remove_routes(self, routes: list[PrefetchRoute]) -> None:
        """Forget `routes`: their components left, or the pipeline version whose calls they start no longer serves."""
        kept = [r for r in self.routes if r not in routes]
        self.routes, self._by_site, self._by_method = [], {}, {}
        self.add_routes(kept)

    def on_call(self, component: Component, method: str, site: CallSite | None, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> None:
        """Called by the front-end's call hook as a call starts, on the event loop; never waits."""
        key = (component._patchkit_spec.uid, method)
        routes = self._by_site.get(site, []) if site is not None else self._by_method.get(key, [])
        routes = [r for r in routes if (r.source_uid, r.source_method) == key]
        if not routes:
            return
        text = args[0] if args else next(iter(kwargs.values()), None)
        if not isinstance(text, str):
            self.counts["skipped"] += len(routes)  # the input is no text a retriever could embed
            return
        for route in routes:
            future = self._submit(route.target_uid, (text,))
            self.counts["issued"] += 1
            self._tasks.add(future)
            future.add_done_callback(self._finished)

    def _finished(self, future: asyncio.Future[Any]) -> None:
        self._tasks.discard(future)
        if future.cancelled():
            self.counts["cancelled"] += 1
            return
        ok, value = future.result()
        if ok:
            self.counts["done"] += 1
            self.bytes_requested += int(value) if isinstance(value, (int, float)) else 0
        else:
            self.counts["failed"] += 1
            logger.debug("prefetch failed: %s", value)

    def stats(self) -> dict[str, Any]:
        return {"routes": len(self.routes), **{k: self.counts[k] for k in ("issued", "done", "failed", "skipped", "cancelled")},
                "bytes_requested": self.bytes_requested}

    def close(self) -> None:
        """Cancel the prefetches still queued; called by the front-end as it closes."""
        for future in list(self._tasks):
            future.cancel()
