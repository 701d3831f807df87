"""`StalenessPolicy`: eta's one home. Its constructor is the only place the rule's settings are checked, and the
learner's actor and worker take the one object the config builds."""

from __future__ import annotations

import numpy as np
import pytest

from arl.api.staleness import StalenessPolicy
from arl.api.types import Trajectory
from arl.config import ConfigError, ExperimentConfig, parse_overrides, staleness_policy


def traj(versions: list[int]) -> Trajectory:
    n = len(versions) + 1
    return Trajectory(input_ids=np.arange(n, dtype=np.int32), loss_mask=np.array([0] + [1] * len(versions), np.int8),
                      logprobs=np.zeros(n, np.float32), versions=np.array([-1, *versions], np.int32), reward=0.0, group_id="g")


@pytest.mark.parametrize("kw, match", [
    (dict(eta=1, stale_tokens="nope"), "stale_tokens"),
    (dict(eta=-1), "max_head_offpolicyness"),
    (dict(eta=None, stale_tokens="drop"), "needs max_head_offpolicyness"),
    (dict(eta=1, stale_tokens="downweight", decay=1.5), "decay"),
])
def test_bad_settings_are_refused_by_the_constructor(kw, match):
    with pytest.raises(ValueError, match=match):
        StalenessPolicy(**kw)


def test_a_decay_that_is_never_used_is_not_checked():
    assert StalenessPolicy(eta=1, stale_tokens="keep", decay=7.0).decay == 7.0


def test_the_config_is_checked_by_the_policy():
    """A downweight decay outside [0, 1] used to pass the config and crash the learner at its first step."""
    with pytest.raises(ConfigError, match="decay"):
        parse_overrides(ExperimentConfig, ["learner.ppo.stale_tokens=downweight", "learner.ppo.stale_token_decay=2"])
    cfg = parse_overrides(ExperimentConfig, ["max_head_offpolicyness=3", "learner.ppo.stale_tokens=drop"])
    assert staleness_policy(cfg) == StalenessPolicy(eta=3, stale_tokens="drop", decay=0.5)


def test_one_rule_for_admission_groups_and_tokens():
    keep, drop = StalenessPolicy(eta=1), StalenessPolicy(eta=1, stale_tokens="drop")
    assert keep.admission_limit(version=3, batch_size=4) == (3 + 1 + 1) * 4
    assert StalenessPolicy().admission_limit(3, 4) > 10**12  # no bound: only max_concurrent limits
    mixed = [traj([2, 4]), traj([])]  # at version 4 with eta 1: token of version 2 lags 2 > 1
    assert keep.group_is_stale(mixed, 4) and not drop.group_is_stale(mixed, 4)
    assert drop.group_is_stale([traj([1, 2])], 4) and not StalenessPolicy().group_is_stale([traj([0])], 9)
    assert keep.exceeded(2.0) and not keep.exceeded(1.0) and not drop.exceeded(5.0)
    t = traj([2, 4])
    m, w = drop.token_weights(t.versions, t.loss_mask, 4)
    assert m.tolist() == [False, False, True] and w.tolist() == [1, 1, 1]
    assert drop.stale(t.versions, t.loss_mask, 4).tolist() == [False, True, False]
    m, w = StalenessPolicy(eta=1, stale_tokens="downweight", decay=0.5).token_weights(t.versions, t.loss_mask, 5)
    assert m.tolist() == [False, True, True] and w.tolist() == [1.0, 0.25, 1.0]


def test_the_learner_actor_and_its_worker_share_the_configured_policy():
    from arl.learner.entry import learner_actor

    cfg = parse_overrides(ExperimentConfig, ["learner.backend=sim", "max_head_offpolicyness=2",
                                             "learner.ppo.stale_tokens=downweight", "learner.ppo.stale_token_decay=0.25"])
    actor, _ = learner_actor(cfg)
    assert actor.staleness == StalenessPolicy(eta=2, stale_tokens="downweight", decay=0.25)
