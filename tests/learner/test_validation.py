import numpy as np

from arl.api import Trajectory
from arl.learner.validation import group_problem


def traj(**kw):
    d = dict(input_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -0.5, -1.0], versions=[-1, -1, 2, 3],
             reward=1.0, group_id="g")
    d.update(kw)
    return Trajectory(**d)


def test_good_group_passes():
    assert group_problem([traj(), traj(reward=0.0)], vocab_size=10, version=3) is None


def test_each_defect_is_named():
    cases = {
        "token id outside": traj(input_ids=[1, 2, 3, 10]),
        "logprobs": traj(logprobs=[0, 0, 0.5, -1.0]),
        "versions outside": traj(versions=[-1, -1, 2, 4]),
        "non-finite reward": traj(reward=float("nan")),
        "no generated token": traj(loss_mask=[0, 0, 0, 0]),
        "need >= 2": traj(input_ids=[1], loss_mask=[1], logprobs=[-1.0], versions=[0]),
    }
    for needle, t in cases.items():
        assert needle in (group_problem([t], vocab_size=10, version=3) or ""), needle
    bad_mask = traj()
    bad_mask.loss_mask = np.array([0, 0, 2, 1], np.int8)
    assert "loss_mask" in group_problem([bad_mask], vocab_size=10, version=3)
    assert group_problem([], vocab_size=10, version=3) == "empty group"
    assert group_problem([traj(input_ids=[1, 2, 3, 99])], vocab_size=None, version=3) is None  # vocab unknown
