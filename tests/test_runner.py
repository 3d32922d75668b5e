"""The request runner's seams: one outcome name per way a request ends, counted once wherever it ends;
the call site a `@make` call hands its hook; the supervisor as the one writer of a replica's state."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import pytest
from components import Retriever
from serving import run_frontend

import patchkit
from patchkit.component import CallSite, Component, MakeMethod, call_hook
from patchkit.errors import ComponentError, DeadlineExceeded, Overloaded, WorkerDiedError
from patchkit.orchestrator.backend import ReplicaSpec, ReplicaState
from patchkit.orchestrator.inprocess import InProcessBackend
from patchkit.orchestrator.supervisor import Supervisor
from patchkit.scheduler.online.frontend import Frontend
from patchkit.scheduler.online.replicas import ReplicaSet
from patchkit.scheduler.online.runner import outcome_of


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (None, "ok"),
        (DeadlineExceeded("past request_timeout_s"), "timeout"),
        (TimeoutError("a component's own: a socket's, a future's"), "error"),
        (Overloaded(3, 2), "overloaded"),
        (Overloaded(0, 0, "the endpoint is shutting down"), "overloaded"),
        (WorkerDiedError("gone"), "worker_died"),
        (asyncio.CancelledError(), "cancelled"),
        (ComponentError("llm", "generate", "ValueError", "boom"), "error"),
        (KeyError("x"), "error"),
    ],
)
def test_each_way_a_request_ends_has_one_outcome_name(error: BaseException | None, outcome: str) -> None:
    assert outcome_of(error) == outcome


retriever = Retriever(topk=1)


def search(query: str) -> list[str]:
    with patchkit.capture():
        return retriever.retrieve(query)


def test_a_request_refused_while_closing_is_counted_as_overloaded_once() -> None:
    """Refused at the front-end's door, as at the admission bound: in stats and in the Prometheus counter."""

    async def body(frontend: Frontend) -> dict[str, Any]:
        await frontend.query({"query": "How do I open a file?"})
        frontend.runner.closing = True
        with pytest.raises(Overloaded, match="shutting down"):
            await frontend.query({"query": "What is a list?"})
        return frontend.stats()["requests"]

    search("How do I sort a list?")
    pipeline = patchkit.last_pipeline()
    assert pipeline is not None
    requests = run_frontend(pipeline, body)
    assert (requests["ok"], requests["overloaded"], requests["inflight"]) == (1, 1, 0)
    assert "error" not in requests


def test_a_hook_gets_the_site_of_the_line_making_the_call_however_deep_the_hook_is() -> None:
    sites: list[CallSite | None] = []

    def hook(component: Component, method: MakeMethod, args: tuple[Any, ...], kwargs: dict[str, Any],
             site: CallSite | None) -> Any:
        sites.append(site)
        return deeper(component, method, args, kwargs)

    def deeper(component: Component, method: MakeMethod, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return method.run_local(component, args, kwargs)  # frames between the call and its hook change nothing

    with call_hook(hook):
        line = inspect.currentframe().f_lineno + 1  # type: ignore[union-attr]
        hits = retriever.retrieve("How do I read a file?")
    assert hits == Retriever(topk=1).retrieve("How do I read a file?")
    [site] = sites
    assert site is not None and (site.filename, site.lineno) == (__file__, line)
    assert site.col < site.end_col


def test_the_supervisor_alone_marks_a_replica_stuck_when_its_set_reports_it() -> None:
    async def scenario() -> tuple[list[ReplicaState], list[str], str]:
        backend = InProcessBackend()
        sets: dict[str, ReplicaSet] = {}
        supervisor = Supervisor(backend, lambda r: sets[r.component].add(r), lambda r, why: sets[r.component].remove(r))
        sets["retriever"] = ReplicaSet("retriever", 2, supervisor.mark_stuck)
        await supervisor.start([ReplicaSpec("retriever", Retriever())])
        [replica] = sets["retriever"].replicas
        states = [replica.state]
        sets["retriever"].stuck(replica, "a batch of retriever.retrieve ran past its call timeout of 1 s")
        states.append(replica.state)
        sets["retriever"].stuck(replica, "reported twice")  # its state says so already: not reported again
        for _ in range(100):
            if sets["retriever"].replicas:
                break
            await asyncio.sleep(0.01)
        replacement = [r.id for r in sets["retriever"].replicas]
        whys = [r.why for r in supervisor.replaced]
        await supervisor.close()
        return states, replacement, " | ".join(whys)

    states, replacement, whys = asyncio.run(scenario())
    assert states == [ReplicaState.SERVING, ReplicaState.STUCK]
    assert replacement == ["retriever#1"]  # another replica took its place
    assert whys == "a batch of retriever.retrieve ran past its call timeout of 1 s"
