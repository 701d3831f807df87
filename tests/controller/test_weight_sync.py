"""WeightSync: ordered, coalesced weight updates per inference server, rejoin, resume and the prunable floor."""

from __future__ import annotations

import random

import pytest

from arl.controller.weight_sync import GiveUp, Rejoin, Send, WeightSync


def test_publish_sends_to_every_server_and_goes_live_once_all_acked():
    ws = WeightSync(2)
    assert ws.publish(1, "/v1") == [Send(0, 1, "/v1"), Send(1, 1, "/v1")]
    assert ws.loaded(0, 1) == [] and ws.advance() is None  # server 1 still has v0
    assert ws.loaded(1, 1) == [] and ws.advance() == (0, 1) and ws.live == 1
    assert ws.advance() is None  # reported once


def test_versions_published_while_loading_are_coalesced_into_the_newest():
    ws = WeightSync(1)
    assert ws.publish(1, "/v1") == [Send(0, 1, "/v1")]
    assert ws.publish(2, "/v2") == [] and ws.publish(3, "/v3") == []  # one load in flight per server
    assert ws.loaded(0, 1) == [Send(0, 3, "/v3")]  # v2 is skipped
    assert ws.advance() == (0, 1)
    assert ws.loaded(0, 3) == [] and ws.advance() == (1, 3)


def test_versions_only_go_up_per_server():
    """Whatever order publishes and acks come in, each server is sent strictly increasing versions, never one
    at or below what it has, and at most one at a time."""
    rng = random.Random(0)
    for _ in range(200):
        ws = WeightSync(3)
        sent: dict[int, list[int]] = {0: [], 1: [], 2: []}
        inflight: dict[int, int] = {}
        v = 0
        for _ in range(30):
            if rng.random() < 0.4:
                v += 1
                actions = ws.publish(v, f"/v{v}")
            elif inflight:
                s = rng.choice(sorted(inflight))
                actions = ws.loaded(s, inflight.pop(s))
            else:
                continue
            for a in actions:
                assert isinstance(a, Send) and a.server not in inflight
                assert not sent[a.server] or a.version > sent[a.server][-1]
                assert a.version > ws.acked[a.server]
                sent[a.server].append(a.version)
                inflight[a.server] = a.version
            ws.advance()
            assert ws.live == min(ws.acked)
        while inflight:  # drain: every server ends on the newest version
            s = next(iter(inflight))
            for a in ws.loaded(s, inflight.pop(s)):
                sent[a.server].append(a.version)
                inflight[a.server] = a.version
        if v:
            assert ws.acked == [v, v, v]


def test_a_late_older_publish_is_not_sent():
    ws = WeightSync(1)
    ws.publish(2, "/v2")
    ws.loaded(0, 2)
    assert ws.publish(1, "/v1") == []
    assert ws.loaded(0, 2) == []  # a duplicate ack sends nothing


def test_loss_while_loading_lets_the_version_go_live():
    ws = WeightSync(2)
    ws.publish(1, "/v1")
    ws.loaded(0, 1)
    assert ws.advance() is None  # server 1 is still loading
    ws.lose([1])
    assert ws.advance() == (0, 1)
    assert ws.publish(2, "/v2") == [Send(0, 2, "/v2")]  # a lost server is sent nothing
    assert ws.loaded(1, 1) == []  # nor answered when a late ack of the dead process arrives
    assert ws.acked[1] == 0


def test_restarted_server_rejoins_with_the_newest_version():
    ws = WeightSync(2)
    ws.publish(3, "/v3")
    ws.loaded(0, 3)
    ws.loaded(1, 3)
    assert ws.advance() == (0, 3)
    ws.lose([1])
    ws.restarted([1])
    assert ws.acked[1] == 0 and ws.rejoining == {1}
    assert ws.loaded(1, 3) == []  # the old incarnation's ack: ignored until the new one registered
    assert ws.registered(1) == [Send(1, 3, "/v3")]
    assert ws.publish(4, "/v4") == [Send(0, 4, "/v4")]  # the rejoining server is busy with v3
    assert ws.loaded(1, 3) == [Send(1, 4, "/v4")]  # not enough: v4 came out meanwhile
    assert ws.loaded(1, 4) == [Rejoin(1, 4)] and ws.lost == set() and ws.rejoining == set()
    assert ws.advance() is None  # server 0 has not acked v4 yet
    ws.loaded(0, 4)
    assert ws.advance() == (3, 4)


def test_restarted_server_rejoins_at_once_before_any_publish():
    ws = WeightSync(2)
    ws.lose([1])
    ws.restarted([1])
    assert ws.registered(1) == [Rejoin(1, 0)]
    assert ws.registered(0) == []  # not restarted: nothing to do


def test_gave_up_server_stays_lost():
    ws = WeightSync(2)
    ws.lose([1])
    ws.restarted([1])
    ws.lose([1])  # the restarted process did not come back
    assert ws.registered(1) == [] and ws.lost == {1} and ws.rejoining == set()


def test_resume_publishes_the_checkpoint_version():
    ws = WeightSync(2)
    assert ws.publish(5, "/v5") == [Send(0, 5, "/v5"), Send(1, 5, "/v5")]
    ws.loaded(0, 5)
    ws.loaded(1, 5)
    assert ws.advance() == (0, 5)


def test_prunable_only_once_every_live_server_acked_a_newer_version():
    ws = WeightSync(2)
    ws.publish(1, "/v1")
    ws.loaded(0, 1)
    ws.loaded(1, 1)
    ws.advance()
    ws.publish(2, "/v2")
    ws.loaded(0, 2)
    ws.advance()
    assert ws.lowest_needed() == 1  # v0 may go, v1 not: server 1 is loading v2
    ws.loaded(1, 2)
    ws.advance()
    assert ws.lowest_needed() == 2
    ws.publish(3, "/v3")
    ws.lose([1])  # a lost server does not hold versions back
    ws.loaded(0, 3)
    ws.advance()
    assert ws.lowest_needed() == 3
    # restarted, it loads the newest (v3) ... while v4 goes live on server 0: v3 stays needed until it acked
    ws.restarted([1])
    ws.registered(1)
    ws.publish(4, "/v4")
    ws.loaded(0, 4)
    assert ws.advance() == (3, 4) and ws.loading(1) and ws.sent[1] == 3
    assert ws.lowest_needed() == 3
    ws.loaded(1, 3)  # then it is sent v4
    assert ws.lowest_needed() == 4


def test_unknown_server_is_refused():
    with pytest.raises(ValueError):
        WeightSync(1).loaded(3, 1)


def test_a_failed_load_is_retried_with_the_newest_then_given_up():
    ws = WeightSync(2, max_load_attempts=3)
    ws.publish(1, "/v1")
    assert ws.load_failed(0, 1, "OSError: x") == [Send(0, 1, "/v1")]  # retried; it still has v0
    assert ws.acked[0] == 0 and ws.loading(0)
    ws.publish(2, "/v2")  # published meanwhile: the next retry sends the newest
    assert ws.load_failed(0, 1, "OSError: x") == [Send(0, 2, "/v2")]
    assert ws.load_failed(0, 1, "OSError: x") == []  # not the load in flight (v2): a stale report
    assert ws.load_failed(0, 2, "OSError: y") == [GiveUp(0, 2, 3, "OSError: y")]  # third in a row
    assert not ws.loading(0) and ws.advance() is None  # the controller fails the server (or the run)
    # a success resets the count
    ws.loaded(1, 1)
    assert ws.loaded(1, 1) == [] and ws.sent[1] == 2
    assert ws.load_failed(1, 2, "e") == [Send(1, 2, "/v2")]
    assert ws.loaded(1, 2) == [] and ws.load_failed(1, 2, "late") == []  # no load in flight: ignored
    ws.publish(3, "/v3")
    assert ws.load_failed(1, 3, "e") == [Send(1, 3, "/v3")] and ws.load_failed(1, 3, "e") == [Send(1, 3, "/v3")]
    # a lost server's reports are ignored
    ws.lose([1])
    assert ws.load_failed(1, 3, "e") == []


def test_only_the_newest_path_is_kept_over_a_long_run():
    ws = WeightSync(1)
    for v in range(1, 5_001):
        ws.publish(v, f"/w/{v}")
        ws.loaded(0, v)
    assert ws.published == {5000: "/w/5000"} and ws.newest == 5000
    assert ws.publish(4_999, "/w/old") == [] and ws.published == {5000: "/w/5000"}


def test_a_rollback_sends_every_server_the_checkpoint_s_version_and_ignores_late_acks_of_lost_ones():
    ws = WeightSync(3)
    ws.publish(1, "/v1")
    for s in range(3):
        ws.loaded(s, 1)
    ws.advance()
    assert ws.publish(2, "/v2") == [Send(0, 2, "/v2"), Send(1, 2, "/v2"), Send(2, 2, "/v2")]
    ws.loaded(0, 2)
    ws.lose([2])  # server 2 is out of the run
    acts = ws.rollback(1, "/c1")  # the restarted learner resumed at v1: lower than what servers have
    assert acts == [Send(0, 1, "/c1", rollback=True), Send(1, 1, "/c1", rollback=True)]
    assert ws.newest == 1 and ws.advance() is None
    assert ws.loaded(1, 2) == []  # server 1's load of the lost v2 finished late: not counted
    assert ws.loaded(0, 1) == [] and ws.loaded(1, 1) == []
    assert ws.advance() == (-1, 1) and ws.live == 1  # v1 is live again: admission may reopen
    assert ws.publish(2, "/n2") == [Send(0, 2, "/n2"), Send(1, 2, "/n2")]  # the new v2 goes up as usual


def test_a_failed_rollback_load_is_sent_again_as_a_rollback():
    ws = WeightSync(1)
    ws.publish(3, "/v3")
    ws.loaded(0, 3)
    ws.advance()
    assert ws.rollback(2, "/c2") == [Send(0, 2, "/c2", rollback=True)]
    assert ws.load_failed(0, 2, "disk") == [Send(0, 2, "/c2", rollback=True)]
    assert ws.publish(3, "/n3") == []  # one load in flight; the new v3 follows the rollback
    assert ws.loaded(0, 2) == [Send(0, 3, "/n3")]
