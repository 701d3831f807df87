"""Peers: the binding rules of registration (who may register as which role) and what it keeps."""

from __future__ import annotations

import json

from arl.controller.peers import Peers
from arl.controller.supervision import Supervisor


def registry(tmp_path=None, **kw) -> Peers:
    sup = Supervisor(num_inference=2, num_rollout=2, startup_timeout=60, servers_per_process=2)
    path = str(tmp_path / "addresses.json") if tmp_path is not None else ""
    return Peers(num_inference=2, num_rollout=2, process_of=sup.process_of, path=path, **kw)


def test_a_registration_must_name_a_role_and_index_of_the_run():
    r = registry()
    assert r.register(b"x", "rollout", 2, None, heard=set())[0] == "bad_register"
    assert r.register(b"x", "learner", 1, None, heard=set())[0] == "bad_register"
    assert r.register(b"x", "wizard", 0, None, heard=set())[0] == "bad_register"
    assert r.register(b"x", "inference", 0, None, heard=set())[0] == "bad_register"  # no address
    assert r.peers == {} and r.who == {}


def test_a_live_role_keeps_its_identity_and_a_new_incarnation_takes_over_a_dead_ones():
    r = registry()
    assert r.register(b"i0", "inference", 0, "tcp://a:0", heard=set()) is None
    heard = {("inference", 0)}
    kind, text = r.register(b"evil", "inference", 0, "tcp://evil:0", heard=heard)
    assert kind == "register_taken" and "inference0" in text
    assert r.peers[("inference", 0)] == b"i0" and r.addresses["inference"][0] == "tcp://a:0" and b"evil" not in r.who
    assert r.register(b"i0", "inference", 0, "tcp://a:0", heard=heard) is None  # the same peer again (a lost ack)
    assert r.register(b"i0b", "inference", 0, "tcp://b:0", heard=set()) is None  # no longer heard: a new one
    assert r.peers[("inference", 0)] == b"i0b" and r.who == {b"i0b": ("inference", 0)}
    assert r.addresses["inference"][0] == "tcp://b:0"
    r.forget(("inference", 0))
    assert r.peers == {} and r.who == {}


def test_processes_lookups_and_prompt_positions():
    r = registry(prompt_positions={1: 5})
    assert r.register(b"i1", "inference", 1, "tcp://a:1", heard=set()) is None
    assert r.has_process("inference0") and not r.has_process("learner")  # servers 0 and 1 share a process
    assert not r.complete()
    r.register(b"i0", "inference", 0, "tcp://a:0", heard=set())
    r.register(b"L", "learner", 0, "tcp://l:0", heard=set())
    assert r.complete()
    r.note_position(1, 3)  # behind the resumed position: kept
    r.note_position(0, 7)
    r.note_position(0, "8")  # not a position
    assert r.prompt_position("rollout", 1) == {"1": 5} and r.prompt_position("rollout", 0) == {"0": 7}
    assert r.prompt_position("inference", 0) is None


def test_prompt_streams_are_reported_per_stream_and_adopted_by_a_worker_that_stays():
    # resumed from a run that had scaled to 4 workers: streams 2 and 3 go to workers 0 and 1 (s % 2)
    r = registry(prompt_positions={0: 4, 2: {"low": 3, "above": [5]}, 3: 1})
    assert r.streams_of(0) == [0, 2] and r.streams_of(1) == [1, 3]
    assert r.prompt_position("rollout", 0) == {"0": 4, "2": {"low": 3, "above": [5]}}
    assert r.prompt_position("rollout", 1) == {"3": 1}  # stream 1: nothing settled yet
    r.note_position(1, {"1": 6, "3": {"low": 2, "above": []}})  # each stream moves on by itself
    assert r.positions[1] == 6 and r.positions[3] == {"low": 2, "above": []}
    r.note_position(1, {"x": 1})  # malformed: ignored
    # worker 1 leaves: worker 0 draws its streams from their last reported positions
    assert r.adopt(r.streams_of(1), 0) == {"1": 6, "3": {"low": 2, "above": []}}
    assert r.streams_of(0) == [0, 1, 2, 3] and r.streams_of(1) == []
    assert set(r.prompt_position("rollout", 0)) == {"0", "1", "2", "3"}


def test_addresses_file(tmp_path):
    r = registry(tmp_path)
    r.register(b"L", "learner", 0, "tcp://l:0", heard=set())
    r.write("tcp://ctl:1")
    with open(tmp_path / "addresses.json") as f:
        assert json.load(f) == {"controller": "tcp://ctl:1", "inference": [None, None], "learner": "tcp://l:0"}


def test_who_may_send_what():
    r = registry()
    r.register(b"L", "learner", 0, "tcp://l:0", heard=set())
    r.register(b"r1", "rollout", 1, None, heard=set())
    assert r.unknown_peer(b"x", "register", {}) is None and r.unknown_peer(b"x", "lookup", {}) is None
    kind, text = r.unknown_peer(b"x", "error", {"message": "boom"})
    assert kind == "unknown_peer" and text.endswith(": boom")
    assert r.unknown_peer(b"L", "heartbeat", {}) is None
    assert r.wrong_sender(b"L", "group_done") == ("unexpected_group_done", "dropped a group_done from learner0")
    assert r.wrong_sender(b"r1", "group_received") == ("unexpected_group_received",
                                                       "dropped a group_received from rollout1")
    assert r.wrong_sender(b"r1", "group_done") is None and r.wrong_sender(b"L", "groups_dropped") is None
    assert r.wrong_sender(b"L", "heartbeat") is None  # any role may
    r.heard_from(b"r1", "heartbeat", 5.0)
    r.heard_from(b"x", "heartbeat", 6.0)  # nobody's
    assert r.last_messages == {"rollout1": {"heartbeat": 5.0}}


def test_a_trainable_policys_learner_registers_as_learner_k_and_lookups_wait_for_it():
    sup = Supervisor(num_inference=1, num_rollout=1, startup_timeout=60, num_policy_learners=1)
    r = Peers(num_inference=1, num_rollout=1, process_of=sup.process_of, num_policy_learners=1)
    assert r.register(b"i", "inference", 0, "tcp://i:1", heard=set()) is None
    assert r.register(b"l", "learner", 0, "tcp://l:1", heard=set()) is None
    assert not r.complete()  # the rival's learner has not said where it listens
    assert r.register(b"x", "learner", 2, "tcp://x:1", heard=set())[0] == "bad_register"
    assert r.register(b"p", "learner", 1, "tcp://p:1", heard=set()) is None
    assert r.complete() and r.addresses["learner"] == "tcp://l:1"
    assert r.addresses["policy_learners"] == ["tcp://p:1"] and r.process_of("learner", 1) == "learner1"
