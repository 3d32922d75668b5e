"""deploy(pipelining=False): requests run in waves, a new one waiting until the running wave is done."""

from __future__ import annotations

import asyncio

import patchkit
from patchkit import Component, make
from patchkit.serving.waves import Waves
from tests.serving import run_frontend


def test_a_request_waits_for_the_running_wave_and_joins_the_next_with_the_others() -> None:
    async def main() -> list[str]:
        waves, order = Waves(), []

        async def request(name: str, hold: asyncio.Event) -> None:
            await waves.enter()
            order.append(f"{name} in")
            await hold.wait()
            waves.leave()

        first, second, third = asyncio.Event(), asyncio.Event(), asyncio.Event()
        tasks = [asyncio.create_task(request("a", first))]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(request("b", second)), asyncio.create_task(request("c", third))]
        await asyncio.sleep(0.01)
        assert order == ["a in"] and waves.waiting == 2
        first.set()
        await asyncio.sleep(0.01)
        assert order == ["a in", "b in", "c in"] and waves.running == 2 and waves.waves == 2
        tasks.append(asyncio.create_task(request("d", asyncio.Event())))
        second.set()
        await asyncio.sleep(0.01)
        assert "d in" not in order  # c still runs: its wave is not over
        third.set()
        await asyncio.sleep(0.01)
        assert order[-1] == "d in"
        tasks[-1].cancel()
        return order

    asyncio.run(main())


def test_a_cancelled_waiter_leaves_no_place_in_the_next_wave() -> None:
    async def main() -> None:
        waves = Waves()
        await waves.enter()
        waiter = asyncio.create_task(waves.enter())
        await asyncio.sleep(0)
        waiter.cancel()
        await asyncio.sleep(0)
        assert waves.waiting == 0
        waves.leave()
        assert waves.running == 0
        await asyncio.wait_for(waves.enter(), 1)  # idle again: a new request starts a wave at once

    asyncio.run(main())


class Stage(Component):
    @make(batch=True)
    def run(self, x: list[int]) -> list[int]:
        return [v + 1 for v in x]


first, second = Stage(), Stage()


def test_a_deployment_without_pipelining_answers_every_request() -> None:
    value = 1
    with patchkit.capture(output="out") as pipeline:
        out = second.run(first.run(value))  # noqa: F841 - the output

    async def body(frontend) -> list[int]:  # noqa: ANN001 - the Frontend
        results = await asyncio.gather(*(frontend.query({"value": v}) for v in range(20)))
        waves = frontend.route().runner.waves
        assert waves is not None and waves.waves < 20  # requests shared waves
        return [r.output for r in results]

    assert run_frontend(pipeline, body, pipelining=False) == [v + 2 for v in range(20)]
