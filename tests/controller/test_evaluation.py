"""EvalSchedule: which versions are evaluated (coalesced versions included), a resumed run's start, pending
evaluations to ask again, and when the run is done."""

from __future__ import annotations

from arl.controller.evaluation import EvalSchedule


def test_fresh_run_evaluates_version_0_then_every_nth_and_the_last():
    s = EvalSchedule(total_steps=6, every=2)
    assert s.awaiting_start() and s.request(0) == [0] and not s.awaiting_start()
    assert s.finished(0) == (True, False)  # the start version's: admission opens
    assert s.live(0, 1, gate_version=0) == []
    assert s.live(1, 2, gate_version=1) == [2]
    assert s.live(2, 3, gate_version=2) == []
    assert s.pending() == [2]
    assert s.finished(2) == (False, False) and s.pending() == []
    assert s.live(3, 6, gate_version=3) == [6]  # the last version, whatever `every` says
    assert s.finished(6) == (False, True)


def test_a_version_skipped_by_coalesced_updates_is_evaluated_at_the_version_that_went_live():
    s = EvalSchedule(total_steps=20, every=4)
    s.request(0)
    assert s.live(2, 5, gate_version=2) == [5]  # 4 was skipped: its evaluation runs at 5
    assert s.live(5, 7, gate_version=5) == []
    assert s.live(7, 9, gate_version=7) == [9]  # 8 skipped
    assert EvalSchedule(total_steps=20, every=0).live(2, 5, gate_version=2) == []  # every=0: only the last


def test_the_run_is_done_only_once_every_evaluation_is_in():
    s = EvalSchedule(total_steps=4, every=2)
    s.request(0)
    s.finished(0)
    assert s.live(1, 2, gate_version=1) == [2] and s.live(2, 4, gate_version=2) == [4]
    assert s.finished(4) == (False, False)  # v2's evaluation is still out
    assert s.pending() == [2]  # what a restarted rollout worker 0 is asked again
    assert s.finished(2) == (False, True)


def test_resumed_run_evaluates_its_start_version_once_the_checkpoint_weights_are_live():
    s = EvalSchedule(total_steps=10, every=5, start_version=3)
    assert s.awaiting_start()  # nothing at registration: the checkpoint's weights load first
    assert s.live(0, 3, gate_version=3) == [3]  # live everywhere: not above the gate, the start evaluation
    assert not s.awaiting_start() and s.live(0, 3, gate_version=3) == []  # asked once
    assert s.finished(3) == (True, False)
    assert s.live(3, 5, gate_version=3) == [5]
    assert EvalSchedule(total_steps=10, every=5, start_version=3).live(0, 2, gate_version=3) == []  # not the start


def test_a_start_evaluation_already_reported_is_not_asked_for_again():
    s = EvalSchedule(total_steps=4, every=0)
    assert s.finished(0) == (True, False)
    assert not s.awaiting_start() and s.pending() == []
