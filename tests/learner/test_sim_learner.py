import os

import numpy as np
import pytest
from safetensors.numpy import load_file

from arl.api.engine import TrainBatch, TrainEngine
from arl.api.staleness import StalenessPolicy
from arl.api.types import Trajectory
from arl.config import PPOConfig, SimLearnerConfig
from arl.learner.actor import PPOActor
from arl.learner.sim_learner import SimLearner
from arl.learner.worker import staleness_counts


def traj(versions, prompt=3, gid="g"):
    n = len(versions)
    return Trajectory(input_ids=np.arange(prompt + n), loss_mask=[0] * prompt + [1] * n,
                      logprobs=np.zeros(prompt + n), versions=[-1] * prompt + list(versions), reward=1.0,
                      group_id=gid)


def test_engine_sleeps_per_token_and_saves_its_version(tmp_path):
    s = SimLearner(SimLearnerConfig(s_per_token=1e-6, step_base_s=0.0, time_scale=0.5), version=2)
    assert isinstance(s, TrainEngine)
    assert s.step_seconds(1000) == pytest.approx(0.5e-3)
    batch = TrainBatch([traj([0, 1, 2]), traj([2, 2])])
    assert [lp is t.logprobs for lp, t in zip(s.forward_logprobs(batch), batch.trajs)] == [True, True]

    def no_loss(*_):
        raise AssertionError("the simulated engine computes no loss")

    assert s.train_batch(batch, no_loss, no_loss) == {"sim_step_seconds": pytest.approx(0.5 * 11e-6)}
    path = tmp_path / "w" / "v2.safetensors"
    s.export_weights(str(path))
    assert load_file(str(path))["sim.version"].tolist() == [2]
    assert s.save(str(tmp_path / "ckpt"), client_state={"groups_consumed": 4}) == str(tmp_path / "ckpt" / "v2")
    t = SimLearner(SimLearnerConfig())
    assert t.load(str(tmp_path / "ckpt")) == {"groups_consumed": 4} and t.version == 2


def test_actor_over_the_sim_engine_reports_offpolicyness():
    s = SimLearner(SimLearnerConfig(s_per_token=1e-6, step_base_s=0.0, time_scale=0.5), version=2)
    actor = PPOActor(s, PPOConfig(), staleness=StalenessPolicy(1))
    m = actor.step([traj([0, 1, 2], gid="a"), traj([2, 2], gid="a")])
    assert s.version == 3
    assert m["head_offpolicyness"] == 2 and m["tail_offpolicyness"] == 0 and m["n_seqs"] == 2
    assert m["n_tokens"] == 5 and m["sim_step_seconds"] == pytest.approx(0.5 * 11e-6)
    assert m["stale_token_frac"] == pytest.approx(1 / 5) and m["reward_mean"] == 1.0 and m["reward_std"] == 0.0
    assert "loss" not in m  # nothing was trained
    with pytest.raises(ValueError):
        actor.step([])


def test_staleness_counts_per_token():
    assert staleness_counts([traj([0, 1, 2]), traj([2, 2])], 2) == {0: 3, 1: 1, 2: 1}
    assert staleness_counts([traj([])], 5) == {}


def test_the_sim_learner_checkpoints_in_the_real_layout_and_resumes(tmp_path):
    from arl.learner.checkpoint import latest_checkpoint, read_checkpoint_state

    s = SimLearner(SimLearnerConfig(), version=2)
    s.save(str(tmp_path), {"data_position": {"0": {"low": 3, "above": [5]}}}, keep_last=2)
    s.version = 4
    s.save(str(tmp_path), {"data_position": {"0": {"low": 8, "above": []}}}, keep_last=2)
    s.version = 6
    s.save(str(tmp_path), {"data_position": {}}, keep_last=2)
    assert latest_checkpoint(str(tmp_path)).endswith("v6") and sorted(os.listdir(tmp_path)) == ["latest", "v4", "v6"]
    assert read_checkpoint_state(str(tmp_path))["version"] == 6  # what the launcher reads for recover=auto
    back = SimLearner(SimLearnerConfig())
    assert back.load(str(tmp_path), tag="v4") == {"data_position": {"0": {"low": 8, "above": []}}}
    assert back.version == 4 and back.load(str(tmp_path)) == {"data_position": {}} and back.version == 6
    with pytest.raises(FileNotFoundError):
        SimLearner(SimLearnerConfig()).load(str(tmp_path / "none"))
