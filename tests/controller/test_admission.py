"""Admission: grants in turn under the staleness gate, held groups, release on worker loss."""

from __future__ import annotations

import pytest

from arl.controller.admission import Admission
from arl.rollout.staleness import StalenessGate
from arl.api.staleness import StalenessPolicy


def make(batch_size: int = 2, eta: int = 0, max_concurrent: int = 8, max_groups=None) -> Admission:
    return Admission(StalenessGate(batch_size=batch_size, policy=StalenessPolicy(eta), max_concurrent=max_concurrent,
                                   max_groups=max_groups))


def test_nothing_is_granted_before_open():
    a = make()
    assert a.acquire("w0", 2) == []
    assert a.open() == [("w0", 2)] and a.held == {"w0": 2}


def test_grants_go_to_waiting_workers_in_turn_bounded_by_staleness():
    a = make(batch_size=2, eta=1)  # (0 + 1 + 1) * 2 = 4 groups may run at version 0
    a.open()
    assert a.acquire("w0", 3) == [("w0", 3)]
    assert a.acquire("w1", 3) == [("w1", 1)] and a.waiting() == 2
    assert a.acquire("w0", 2) == []  # behind w1, which asked first
    assert a.group_done("w0", True) == []  # accepted groups keep their budget until the version moves
    assert a.set_version(1) == [("w1", 1), ("w0", 1)]  # budget 6: one each, w1 first
    assert a.group_done("w0", False) == [("w1", 1)]  # a rejected group frees its slot: w1's turn again
    assert a.waiting() == 1 and a.gate.running == 5 and a.held == {"w0": 2, "w1": 3}


def test_a_worker_that_joins_later_is_not_starved_by_an_earlier_ones_backlog():
    a = make(batch_size=4, eta=0, max_concurrent=64)  # 4 groups may run at a time
    a.open()
    assert a.acquire("w0", 64) == [("w0", 4)]  # it asks for all it could run
    assert a.acquire("w1", 64) == []
    for _ in range(4):
        a.group_done("w0", True)
    assert a.set_version(1) == [("w0", 2), ("w1", 2)]  # the gate's room is shared evenly
    assert a.waiting() == 58 + 62


def test_groups_dropped_by_the_learner_return_budget():
    a = make(batch_size=1, eta=0)
    a.open()
    assert a.acquire("w0", 2) == [("w0", 1)]
    a.group_done("w0", True)
    assert a.grant() == []
    assert a.groups_dropped(1) == [("w0", 1)]


def test_group_done_without_a_held_group_is_refused():
    a = make()
    a.open()
    with pytest.raises(ValueError):
        a.group_done("w0", True)
    assert a.gate.running == 0


def test_lost_worker_releases_what_it_held_and_its_requests():
    a = make(batch_size=2, eta=1, max_concurrent=3)
    a.open()
    a.acquire("w0", 2)
    a.acquire("w1", 2)
    assert a.held == {"w0": 2, "w1": 1}
    a.acquire("w0", 5)
    lost, grants = a.worker_lost("w0")
    assert lost == 2 and grants == [("w1", 1)] and "w0" not in a.held and a.waiting() == 0
    assert a.gate.running == 2 and a.gate.rejected == 2


def test_zero_want_does_not_block_the_queue():
    a = make()
    a.open()
    assert a.acquire("w0", 0) == []
    assert a.acquire("w1", 1) == [("w1", 1)]


def test_end_of_run_stops_admitting():
    a = make(batch_size=2, eta=5, max_groups=3)
    a.open()
    assert a.acquire("w0", 5) == [("w0", 3)]


def test_the_learners_receipt_settles_a_group_once():
    a = make(batch_size=2, eta=1)
    a.open()
    a.acquire(0, 3, incarnation="aa")
    # group_done first, then its receipt: one acceptance
    assert a.group_done(0, True, "w0.aag0") == [] and a.received(0, "aa", "w0.aag0", 2) == "known"
    # receipt first, then group_done: one acceptance
    assert a.received(0, "aa", "w0.aag1", 2) == "settled" and a.held[0] == 1 and a.gate.accepted == 2
    assert a.group_done(0, True, "w0.aag1") == [] and a.gate.accepted == 2 and a.held[0] == 1
    with pytest.raises(ValueError):  # a replayed group_done settles nothing
        a.group_done(0, True, "w0.aag0")
    assert a.received(0, "zz", "w0.zzg0") == "unknown" and a.gate.accepted == 2 and a.gate.running == 1


def test_a_group_pushed_by_a_worker_that_died_before_group_done_counts_as_accepted():
    a = make(batch_size=2, eta=0)
    a.open()
    a.acquire(0, 2, incarnation="aa")
    assert a.received(0, "aa", "w0.aag0", 3) == "settled"  # pushed; the worker dies before its group_done
    assert a.orphans(0) == [3]
    lost, _ = a.worker_lost(0)  # its other group is lost ...
    assert lost == 1 and a.gate.accepted == 1 and a.gate.running == 0 and a.gate.rejected == 1
    assert a.gate.capacity() == 1  # ... and its budget returned; the received one keeps its budget
    # a receipt that comes after the worker was declared lost reclaims one of its released groups
    assert a.received(0, "aa", "w0.aag1", 3) == "reclaimed" and a.gate.accepted == 2 and a.gate.capacity() == 0
    assert a.received(0, "aa", "w0.aag2", 3) == "unknown"  # it never held a third


def test_settled_groups_are_forgotten_after_a_while_open_ones_are_not():
    a = make(batch_size=1, eta=1_000_000, max_concurrent=1 << 20)
    a.max_closed = 64
    a.open()
    a.acquire(0, 1_000, incarnation="aa")
    assert a.received(0, "aa", "w0.aag0", 2) == "settled"  # open: its group_done is still to come
    for n in range(1, 1_000):  # both halves of 999 groups, either order
        gid = f"w0.aag{n}"
        if n % 2:
            a.group_done(0, True, gid)
            assert a.received(0, "aa", gid, 2) == "known"
        else:
            assert a.received(0, "aa", gid, 2) == "settled"
            a.group_done(0, True, gid)
    assert len(a._groups) == 1 and len(a._closed) == 64  # memory: the open one and the newest closed ones
    with pytest.raises(ValueError):  # a recent duplicate is still refused
        a.group_done(0, True, "w0.aag999")
    assert a.received(0, "aa", "w0.aag998", 2) == "known"
    assert a.group_done(0, True, "w0.aag0") == [] and a.gate.accepted == 1_000  # the open one settled once


def test_a_learner_rollback_takes_the_gate_back_and_reopens_once_its_version_is_live():
    a = make(batch_size=2, eta=1)
    a.open()
    assert a.acquire(0, 8) == [(0, 4)]  # (0 + 1 + 1) * 2
    for _ in range(3):
        a.group_done(0, True)
    assert a.set_version(2) == [(0, 4)]  # limit (2 + 2) * 2 = 8, accepted 3, running 1 -> 4 more
    a.pause()  # the learner is gone: nothing is granted while it comes back
    assert a.acquire(1, 2) == [] and a.group_done(0, True) == [] and not a.is_open
    a.rollback(1, accepted=2)  # its checkpoint: version 1, 2 groups consumed
    assert (a.gate.version, a.gate.accepted, a.gate.running, a.gate.owed) == (1, 2, 4, 0)
    assert a.went_live(0) == [] and not a.is_open  # an older version going live does not reopen it
    assert a.went_live(1) == [] and a.is_open  # (1 + 2) * 2 - 2 - 4 = 0: room comes as groups end
    assert a.group_done(0, False) == [(1, 1)]  # a lost_version drop returns its budget to the waiting worker
    assert a.went_live(2) == [(1, 1)] and a.gate.version == 2
