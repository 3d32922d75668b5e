"""The routing policy on its own: least loaded, prefix affinity within a quarter of the slots, waiting
for a full holder. No replica, process or event loop: the router reads `alive` and `inflight` only."""

from __future__ import annotations

from dataclasses import dataclass

from patchkit.serving.router import Router


@dataclass(eq=False)
class View:
    name: str
    inflight: int = 0
    alive: bool = True


def test_the_least_loaded_alive_replica_with_room_gets_the_batch() -> None:
    a, b, c = View("a", inflight=1), View("b", inflight=0, alive=False), View("c", inflight=1)
    router: Router[View] = Router(max_inflight=2)
    assert router.pick([a, b, c], None) is a  # b is dead; of equals, the first
    a.inflight = 2
    assert router.pick([a, b, c], None) is c
    c.inflight = 2
    assert router.pick([a, b, c], None) is None  # every live replica is full


def test_a_partial_batch_goes_only_to_an_idle_replica() -> None:
    busy, idle = View("busy", inflight=1), View("idle")
    router: Router[View] = Router(max_inflight=2)
    assert router.pick([busy], None, full=False) is None
    assert router.pick([busy, idle], None, full=False) is idle


def test_a_prefix_goes_back_to_its_holder_while_it_is_at_most_a_quarter_of_the_slots_busier() -> None:
    first, second = View("first"), View("second")
    router: Router[View] = Router(max_inflight=8)  # a quarter: 2 slots
    assert router.pick([first, second], "doc-7") is first
    first.inflight = 2  # two busier than the least loaded: still the holder's
    assert router.pick([first, second], "doc-7") is first and router.prefix_hits == 1
    first.inflight = 3  # three busier: the least loaded takes it, and holds the prefix from now on
    assert router.pick([first, second], "doc-7") is second
    first.inflight = 0
    assert router.pick([first, second], "doc-7") is second and router.prefix_hits == 2


def test_a_call_waits_for_its_full_holder_unless_it_is_much_busier() -> None:
    holder, other = View("holder"), View("other")
    router: Router[View] = Router(max_inflight=2)
    router.pick([holder, other], "system+doc-1")
    holder.inflight, other.inflight = 2, 1  # full, but one busier than the least loaded: worth the wait
    assert router.holder_full([holder, other], "system+doc-1", other)
    assert not router.holder_full([holder, other], "another prefix", other)
    holder.alive = False
    assert not router.holder_full([holder, other], "system+doc-1", other)  # a dead holder holds nothing


def test_the_router_forgets_the_oldest_prefixes_past_its_memory() -> None:
    a, b = View("a"), View("b")
    router: Router[View] = Router(max_inflight=4, memory=2)
    router.pick([a, b], "p1")
    a.inflight = 1  # b is now the least loaded
    router.pick([a, b], "p2")
    router.pick([a, b], "p3")  # p1 forgotten
    a.inflight, b.inflight = 1, 0
    assert router.pick([a, b], "p1") is b  # no holder remembered: the least loaded
    assert router.prefix_hits == 0
