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


def test_the_controller_finishes_when_the_evaluations_come_back_out_of_order(tmp_path):
    """Evaluations of v2 and v4 (the last) are out; v4's result comes first: the run is done once v2's is in too
    (it used to wait for a result of the last version that had already come)."""
    import asyncio

    from .test_controller_faults import make_controller

    async def go() -> None:
        ctl = make_controller(tmp_path, num_rollout=1, eval_every=2, total_train_steps=4)
        await ctl._dispatch(b"i0", "register", {"role": "inference", "index": 0, "address": "tcp://i:0"})
        await ctl._dispatch(b"L", "register", {"role": "learner", "index": 0, "address": "tcp://l:0"})
        await ctl._dispatch(b"r0", "register", {"role": "rollout", "index": 0})
        await ctl._dispatch(b"r0", "eval_done", {"version": 0, "n": 1, "first_acc": 0.0, "solved_acc": 0.0})
        for v in (2, 4):
            await ctl._dispatch(b"L", "weights_published", {"version": v, "path": f"/w/v{v}"})
            await ctl._dispatch(b"i0", "weights_loaded", {"version": v, "index": 0})
        assert [p["version"] for _, t, p in ctl.router.sent if t == "eval"] == [0, 2, 4]
        await ctl._dispatch(b"r0", "eval_done", {"version": 4, "n": 1, "first_acc": 0.0, "solved_acc": 0.0})
        assert not ctl._done.is_set()
        await ctl._dispatch(b"r0", "eval_done", {"version": 2, "n": 1, "first_acc": 0.0, "solved_acc": 0.0})
        assert ctl._done.is_set()
        ctl.reporter.close()

    asyncio.run(go())


def test_a_rollback_evaluates_the_versions_after_it_again_when_they_are_reached():
    s = EvalSchedule(total_steps=4, every=1)
    s.request(0)
    s.finished(0)
    assert s.live(0, 1, 0) == [1] and s.live(1, 2, 1) == [2]
    assert s.finished(1) == (False, False)
    s.rollback(1)  # the learner restarted from v1: v2's evaluation (pending) is asked again when v2 is reached
    assert s.pending() == [] and not s.awaiting_start()
    assert s.finished(2) == (False, False) and s.pending() == []  # a late result of the lost v2: ignored
    assert s.live(1, 2, 1) == [2] and s.pending() == [2]
    assert s.finished(2) == (False, False) and s.live(2, 4, 2) == [4] and s.finished(4) == (False, True)
