"""`PhaseTimer`, the one way the learner and the rollout worker time their phases."""

from __future__ import annotations

import pytest

from arl.utils.timer import PhaseTimer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_phases_accumulate_until_popped():
    clock = Clock()
    t = PhaseTimer(clock)
    with t.phase("wait"):
        clock.now += 2.0
    t.start("step")
    clock.now += 3.0
    t.start("wait")  # ends 'step'
    clock.now += 1.0
    t.stop()
    clock.now += 100.0  # no phase running: not counted
    assert t.pop() == {"wait": 3.0, "step": 3.0}
    assert t.pop() == {}


def test_pop_ends_the_running_phase_and_a_raising_block_is_still_timed():
    clock = Clock()
    t = PhaseTimer(clock)
    t.start("step")
    clock.now += 1.5
    assert t.pop() == {"step": 1.5}
    with pytest.raises(RuntimeError):
        with t.phase("group"):
            clock.now += 0.5
            raise RuntimeError("boom")
    assert t.seconds == {"group": 0.5}

