"""The session cap: FIFO, groups take their slots at once, a cancelled waiter gives its place back, the gauges,
the auto limit, and the saturation line."""

from __future__ import annotations

import asyncio

import pytest

from arl.rollout.session_slots import SessionSlots, saturation_warning, session_limit

pytestmark = pytest.mark.timeout(30)


@pytest.mark.asyncio
async def test_groups_run_within_the_cap_in_order():
    slots = SessionSlots(4)
    order, peak = [], [0]

    async def group(name: str, n: int, gate: asyncio.Event) -> None:
        async with slots.hold(n):
            order.append(name)
            peak[0] = max(peak[0], slots.running)
            await gate.wait()

    gates = {k: asyncio.Event() for k in "abcd"}
    tasks = [asyncio.create_task(group(k, n, gates[k])) for k, n in zip("abcd", (3, 2, 1, 8))]
    await asyncio.sleep(0.01)
    assert order == ["a"] and slots.running == 3 and slots.waiting == 2 + 1 + 4  # c waits behind b: FIFO
    gates["a"].set()
    await asyncio.sleep(0.01)
    assert order == ["a", "b", "c"] and slots.running == 3 and slots.waiting == 4
    gates["b"].set()
    gates["c"].set()
    await asyncio.sleep(0.01)
    assert order == ["a", "b", "c", "d"] and slots.running == 4  # a group of 8 runs alone, as 4
    gates["d"].set()
    await asyncio.gather(*tasks)
    assert peak[0] <= 4 and slots.running == 0 and slots.waiting == 0


@pytest.mark.asyncio
async def test_a_cancelled_waiter_leaves_the_queue():
    slots = SessionSlots(1)
    gate = asyncio.Event()

    async def hold(n: int) -> None:
        async with slots.hold(n):
            await gate.wait()

    first = asyncio.create_task(hold(1))
    await asyncio.sleep(0.01)
    second, third = asyncio.create_task(hold(1)), asyncio.create_task(hold(1))
    await asyncio.sleep(0.01)
    second.cancel()
    await asyncio.sleep(0.01)
    assert slots.waiting == 1 and slots.running == 1
    gate.set()
    await asyncio.gather(first, third)
    assert second.cancelled() and slots.running == 0 and slots.waiting == 0


@pytest.mark.asyncio
async def test_no_cap_never_waits():
    slots = SessionSlots(0)
    async with slots.hold(1000):
        assert slots.running == 1000 and slots.max_groups(8) is None


def test_auto_limit_and_max_groups():
    assert session_limit(0, in_process=True, cpus=2) == 0
    assert session_limit(0, in_process=False, cpus=2) == 8
    assert session_limit(5, in_process=True, cpus=2) == 5
    assert SessionSlots(8).max_groups(8) == 1 and SessionSlots(8).max_groups(3) == 2 and SessionSlots(4).max_groups(8) == 1


def test_saturation_names_the_agent_and_what_to_change():
    slots = SessionSlots(8)
    slots.running, slots.waiting = 8, 40
    text = saturation_warning("'sub'", slots, children=30, loop_cpu=None, load=9.5, cpus=2)
    assert "'sub' runs 30 processes on 2 CPUs" in text and "rollout.max_concurrent_sessions (now 8)" in text
    assert saturation_warning("'sub'", slots, children=4, loop_cpu=None, load=9.5, cpus=2) is None
    text = saturation_warning("'sdk'", slots, children=0, loop_cpu=99.0, load=5.0, cpus=2)
    assert "event loop is saturated running agent 'sdk'" in text and "rollout.num_workers" in text
    assert saturation_warning("'sdk'", slots, children=0, loop_cpu=99.0, load=3.0, cpus=2) is None  # others idle
    assert saturation_warning("'sdk'", slots, children=0, loop_cpu=60.0, load=9.0, cpus=2) is None  # not this one


class _Proc:
    def __init__(self, kids, cpu):
        self.kids, self.cpu = kids, cpu

    def cpu_percent(self, interval):
        return self.cpu

    def children(self, recursive):
        return [object()] * self.kids


def test_the_watch_says_it_once_and_keeps_it():
    from arl.rollout.session_slots import SaturationWatch

    slots = SessionSlots(8)
    slots.running = 8
    proc = _Proc(kids=2, cpu=10.0)
    watch = SaturationWatch("'sub'", slots, cpus=2, window=3, process=proc)
    assert watch.check() is None
    proc.kids = 40
    said = watch.check()
    assert said and "40 processes" in said
    proc.kids = 0
    assert watch.check() == said
