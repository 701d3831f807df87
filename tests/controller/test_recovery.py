"""plan_failure: what a lost rollout worker or inference process does to the counts and which messages follow."""

from __future__ import annotations

from arl.api.staleness import StalenessPolicy
from arl.controller.admission import Admission
from arl.controller.recovery import Fatal, InferenceLost, RolloutLost, give_up, plan_failure
from arl.controller.supervision import Supervisor
from arl.controller.weight_sync import WeightSync
from arl.rollout.staleness import StalenessGate


def parts(**kw):
    sup = Supervisor(**{"num_inference": 2, "num_rollout": 2, "startup_timeout": 30, **kw})
    sup.all_up = True
    admission = Admission(StalenessGate(batch_size=2, policy=StalenessPolicy(1), max_concurrent=8))
    admission.open()
    return sup, admission, WeightSync(sup.num_inference)


def plan(name, sup, admission, weights, registered=True, spawned=True, now=100.0):
    return plan_failure(name, sup=sup, admission=admission, weights=weights, registered=registered,
                        spawned=spawned, now=now)


def test_a_lost_rollout_worker_loses_its_groups_except_those_the_learner_has():
    sup, admission, weights = parts(max_restarts=1)
    sup.heard(("rollout", 1), 0.0)
    admission.acquire(0, 2)
    admission.acquire(1, 3, incarnation="aa")  # room for 4 (2 * (0 + 1 + 1)): worker 1 gets 2, one waits
    assert admission.held == {0: 2, 1: 2}
    assert admission.received(1, "aa", "w1.aag0", 4) == "settled"  # pushed; its group_done never comes
    p = plan("rollout1", sup, admission, weights)
    assert isinstance(p, RolloutLost) and p.index == 1 and p.restarts == 1 and p.lost_groups == 1
    assert p.orphans == (4,)  # accepted: the learner has it
    assert p.grants == [] and p.tell == () and 1 not in admission.held
    assert ("rollout", 1) not in sup.last_seen and sup.restarted_at == {"rollout1": 100.0}
    assert p.record("x" * 400) == ("rollout_restart", {"reason": "x" * 300, "lost_groups": 1})
    # over the cap, or before it registered: fatal, with the reason
    assert plan("rollout0", sup, admission, weights) == Fatal("the run already restarted 1 rollout workers "
                                                              "(max_restarts)")
    assert isinstance(plan("rollout0", *parts(), registered=False), Fatal)


def test_a_lost_inference_process_leaves_the_acks_and_is_restarted_within_its_cap():
    sup, admission, weights = parts(tolerate_inference_loss=True, restart_inference=True, max_inference_restarts=1)
    sup.heard(("inference", 1), 0.0)
    p = plan("inference1", sup, admission, weights)
    assert p == InferenceLost(servers=[1], remaining=[0], restarts=1)
    assert [(m.TYPE, m.to_payload()) for m in p.tell] == [("worker_lost", {"role": "inference", "indices": [1]})]
    assert weights.lost == {1} and weights.rejoining == {1} and ("inference", 1) not in sup.last_seen
    assert p.record("died") == ("inference_restart", {"servers": [1]})
    # it died again before it came back: lost again, over the cap, so not restarted
    assert plan("inference1", sup, admission, weights) == InferenceLost(servers=[1], remaining=[0])
    assert weights.rejoining == set() and sup.inference_restarts == 1
    # the last server going is fatal
    assert isinstance(plan("inference0", sup, admission, weights), Fatal)


def test_a_restarted_inference_process_given_up_stays_lost():
    sup, admission, weights = parts(tolerate_inference_loss=True, restart_inference=True)
    plan("inference1", sup, admission, weights)
    assert give_up("inference1", sup=sup, weights=weights) == [1]
    assert weights.lost == {1} and weights.rejoining == set() and sup.restarted_at == {}


def test_a_lost_learner_is_restarted_and_its_return_rolls_the_run_back_to_its_checkpoint():
    import pytest

    from arl.controller.evaluation import EvalSchedule
    from arl.controller.recovery import LearnerLost, plan_rollback
    from arl.controller.weight_sync import Send
    from arl.transport import messages as m

    sup, admission, weights = parts(max_learner_restarts=1)
    sup.heard(("learner", 0), 0.0)
    assert admission.acquire(0, 3) == [(0, 3)]  # (0 + 1 + 1) * 2 = 4 may be accepted or running
    admission.group_done(0, True)
    weights.publish(3, "/v3")
    p = plan("learner", sup, admission, weights)
    assert p == LearnerLost(restarts=1, from_version=3) and not admission.is_open  # nothing starts meanwhile
    assert [(x.TYPE, x.to_payload()) for x in p.tell] == [("worker_lost", {"role": "learner", "indices": [0]})]
    assert ("learner", 0) not in sup.last_seen and sup.restarted_at == {"learner": 100.0}
    schedule = EvalSchedule(total_steps=10, every=1)
    state = {"version": 1, "groups_consumed": 2, "data_position": {"0": 7, "2": 4}, "groups_settled": 3,
             "trajectories_settled": 12}
    # worker 0 also draws stream 2 (adopted from a worker that left the run)
    r = plan_rollback(state, address="tcp://h:1", path="/c1", admission=admission, weights=weights,
                      schedule=schedule, streams={0: [0, 2], 1: [1]})
    assert (r.from_version, r.to_version, r.groups_settled, r.trajectories_settled) == (3, 1, 3, 12)
    assert r.actions == [Send(0, 1, "/c1", rollback=True), Send(1, 1, "/c1", rollback=True)]
    assert r.tell == {0: m.LearnerRestarted(address="tcp://h:1", version=1, position={"0": 7, "2": 4}),
                      # the checkpoint settled none of worker 1's prompts: it draws them all again
                      1: m.LearnerRestarted(address="tcp://h:1", version=1,
                                            position={"1": {"low": 0, "above": []}})}
    assert (admission.gate.version, admission.gate.accepted, admission.gate.running) == (1, 2, 2)
    # over the cap: the run stops, saying why
    assert plan("learner", sup, admission, weights) == Fatal("the run already restarted 1 learners "
                                                             "(learner.max_restarts)")
    # a resume state without a usable version is refused by name, before anything is booked
    for bad in ({}, {"version": "1"}, {"version": -1}, {"version": 1, "groups_consumed": "2"},
                {"version": 1, "data_position": [1]}):
        with pytest.raises(ValueError, match="version|groups_consumed|data_position"):
            plan_rollback(bad, address="a", path="p", admission=admission, weights=weights, schedule=schedule,
                          streams={0: [0], 1: [1]})
