import numpy as np
import pytest
from safetensors.numpy import load_file

from arl.api.engine import LearnerEngine
from arl.api.types import Trajectory
from arl.learner.sim_learner import SimLearner
from arl.learner.worker import staleness_counts


def traj(versions, prompt=3):
    n = len(versions)
    return Trajectory(input_ids=np.arange(prompt + n), loss_mask=[0] * prompt + [1] * n,
                      logprobs=np.zeros(prompt + n), versions=[-1] * prompt + list(versions), reward=1.0,
                      group_id="g")


def test_step_metrics_version_and_export(tmp_path):
    s = SimLearner(s_per_token=1e-6, step_base_s=0.0, time_scale=0.5, version=2)
    assert isinstance(s, LearnerEngine)
    assert s.step_seconds(1000) == pytest.approx(0.5e-3)
    m = s.train_step([traj([0, 1, 2]), traj([2, 2])])
    assert s.version == 3
    assert m["head_offpolicyness"] == 2 and m["tail_offpolicyness"] == 0 and m["n_seqs"] == 2
    assert m["n_tokens"] == 11 and m["n_generated_tokens"] == 5
    path = tmp_path / "w" / "v3.safetensors"
    s.export_weights(str(path))
    assert load_file(str(path))["sim.version"].tolist() == [3]
    s.save(str(tmp_path / "ckpt"))
    t = SimLearner()
    t.load(str(tmp_path / "ckpt"))
    assert t.version == 3
    with pytest.raises(ValueError):
        s.train_step([])


def test_staleness_counts_per_token():
    assert staleness_counts([traj([0, 1, 2]), traj([2, 2])], 2) == {0: 3, 1: 1, 2: 1}
    assert staleness_counts([traj([])], 5) == {}
