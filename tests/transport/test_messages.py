"""Typed control messages: round trips through the codec and refusals of bad payloads."""

from __future__ import annotations

import pytest

from arl.transport import messages as m
from arl.transport.codec import CONTROL_TYPES, decode, encode

EXAMPLES = [
    m.Register(role="inference", index=1, address="tcp://h:1", pid=42),
    m.Register(role="rollout", index=0),
    m.Ack(ok=True, prompt_position=7),
    m.Heartbeat(role="learner", index=0, stats={"version": 3, "nested": {"a": [1, 2]}}),
    m.Lookup(role="rollout", index=1),
    m.Addresses(inference=["tcp://a:1", "tcp://a:2"], learner="tcp://l:1"),
    m.GateAcquire(want=3),
    m.GateGrant(n=2),
    m.GroupDone(accepted=True, reason="accepted", n_traj=4, reward_sum=2.5, seconds=1.0,
                traj_stats={"tool_calls": 3}, n_traj_raw=4),
    m.GroupsDropped(n=2, reason="stale"),
    m.WeightsPublished(version=3, path="/w/v3", metrics={"loss": 0.1}),
    m.UpdateWeights(version=3, path="/w/v3"),
    m.WeightsLoaded(version=3, index=1, ms=12.5),
    m.PruneWeights(below=2),
    m.GenAbort(qid="17"),
    m.Eval(version=2, max_prompts=16),
    m.EvalDone(version=2, n=4, first_acc=0.5, solved_acc=0.75, seconds=3.0,
               extra={"errors": {}, "token_versions": [2, 2]}),
    m.Error(message="rollout0: boom"),
    m.WorkerLost(role="inference", indices=[1, 2]),
    m.WorkerBack(role="inference", index=1, address="tcp://b:1"),
    m.Shutdown(reason="run finished"),
    m.JoinWeightGroup(index=1, spec={"master_address": "10.0.0.1", "master_port": 29500, "group_name": "g",
                                     "world_size": 2, "rank": 1, "backend": "gloo"}),
    m.OpenWeightGroup(name="arl-weights-s1-2", server=1),
    m.SendWeights(version=3, servers=[0, 1]),
    m.Register(role="learner", address="tcp://a:1", weights_store="10.0.0.1:29500"),
    m.Ack(ok=True, prompt_position={"0": {"low": 3, "above": [5]}, "2": 0}),
    m.Drain(),
    m.AdoptStreams(streams={"2": {"low": 4, "above": []}}),
]


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda x: x.TYPE)
def test_round_trip_through_the_codec(msg):
    assert msg.TYPE in CONTROL_TYPES
    msg_type, payload = decode(encode(msg.TYPE, msg.to_payload()))
    assert msg_type == msg.TYPE and isinstance(payload, dict)
    assert m.parse(msg_type, payload) == msg


def test_every_control_type_has_a_message():
    assert set(m.MESSAGES) == CONTROL_TYPES


def test_wire_format_is_the_plain_map():
    assert m.Ack().to_payload() == {"ok": True}  # unset optional fields are left out
    assert m.EvalDone(version=1, n=2, first_acc=0.0, solved_acc=1.0, extra={"mean_turns": 1.5}).to_payload() == {
        "version": 1, "n": 2, "first_acc": 0.0, "solved_acc": 1.0, "seconds": 0.0, "mean_turns": 1.5}
    assert m.parse("heartbeat", {"role": "rollout"}) == m.Heartbeat(role="rollout", index=0, stats={})
    assert m.parse("gate_acquire", {"want": 1, "newer_field": 2}) == m.GateAcquire(want=1)  # unknown keys ignored
    assert m.parse("group_done", {"accepted": False, "seconds": 2}).seconds == 2  # an int is a float


@pytest.mark.parametrize("msg_type,payload", [
    ("gate_acquire", {}),
    ("gate_acquire", {"want": "3"}),
    ("gate_acquire", {"want": True}),
    ("gate_acquire", {"want": -1}),
    ("group_done", {"accepted": 1}),
    ("groups_dropped", {"n": 1.5}),
    ("weights_published", {"version": 1, "path": None}),
    ("weights_loaded", {"version": 1}),
    ("heartbeat", {"role": "wizard"}),
    ("heartbeat", {"role": "rollout", "stats": [1]}),
    ("register", {"role": "rollout", "index": "0"}),
    ("register", {"index": 0}),
    ("worker_lost", {"role": "inference", "indices": [1, "2"]}),
    ("eval_done", {"version": 1, "n": 2, "first_acc": "high", "solved_acc": 0.1}),
    ("addresses", {"inference": [1], "learner": None}),
    ("gate_grant", None),
    ("gate_grant", [1]),
    ("no_such_type", {}),
])
def test_bad_payloads_raise_value_error(msg_type, payload):
    with pytest.raises(ValueError):
        m.parse(msg_type, payload)
