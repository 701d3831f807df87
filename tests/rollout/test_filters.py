"""Void-turn and success-rate filters."""

import numpy as np

from arl.api import Trajectory
from arl.rollout.filters import apply_filters, uniform_rewards, void_turn_filter


def traj(reward, void=0):
    return Trajectory(np.arange(4), [0, 0, 1, 1], np.zeros(4), [-1, -1, 0, 0], reward, "g",
                      metadata={"void_turns": void})


def test_void_turn_filter():
    kept, n = void_turn_filter([traj(1), traj(0, void=1), traj(0)])
    assert n == 1 and [t.reward for t in kept] == [1, 0]


def test_apply_filters_reasons_and_counts():
    group = [traj(1), traj(0, void=1), traj(0)]
    kept, reason, counts = apply_filters(group, void_turns=True, uniform_groups=True)
    assert len(kept) == 2 and reason is None and counts == {"void_trajectories": 1}
    kept, reason, counts = apply_filters([traj(0, void=1), traj(0, void=2)], void_turns=True)
    assert kept == [] and reason == "filtered:void_turns" and counts["void_trajectories"] == 2
    kept, reason, _ = apply_filters([traj(1), traj(1), traj(1)], uniform_groups=True)
    assert kept == [] and reason == "filtered:uniform_reward"
    # the void filter can leave a uniform group behind
    kept, reason, counts = apply_filters([traj(1), traj(0, void=1)], void_turns=True, uniform_groups=True)
    assert reason == "filtered:uniform_reward" and counts["void_trajectories"] == 1
    # off: nothing dropped
    kept, reason, _ = apply_filters([traj(1), traj(1)])
    assert len(kept) == 2 and reason is None
    assert uniform_rewards([traj(0.5), traj(0.5 + 1e-12)]) and not uniform_rewards([traj(0.5), traj(0.6)])
