"""`recover=auto` keeps the prompt streams of rollout workers that joined mid-run (they are drawn by the workers of
the resumed run) and drops the positions of a checkpoint whose streams were laid out for another worker count."""

from __future__ import annotations

import json
import os

from arl.config import ExperimentConfig
from arl.launch.run import resume_state


def checkpoint(run_dir, **state) -> None:
    d = os.path.join(run_dir, "checkpoints", "v3")
    os.makedirs(d)
    with open(os.path.join(run_dir, "checkpoints", "latest"), "w") as f:
        f.write("v3")
    with open(os.path.join(d, "arl_state.json"), "w") as f:
        json.dump({"version": 3, **state}, f)


def cfg(workers: int) -> ExperimentConfig:
    c = ExperimentConfig()
    c.recover, c.run_name = "auto", "r"
    c.rollout.num_workers = workers
    return c


def test_streams_of_workers_that_joined_are_kept_and_another_layout_restarts(tmp_path):
    positions = {"0": 5, "1": {"low": 2, "above": [4]}, "2": 1}  # a 2-worker run scaled to 3
    checkpoint(str(tmp_path), data_position=positions, prompt_shards=2)
    assert resume_state(cfg(2), str(tmp_path))["data_position"] == positions
    assert resume_state(cfg(3), str(tmp_path))["data_position"] == {}  # stream 2 would be another shard now
    legacy = tmp_path / "legacy"
    checkpoint(str(legacy), data_position={"0": 5, "1": 3})  # from before prompt_shards: one stream per worker
    assert resume_state(cfg(2), str(legacy))["data_position"] == {"0": 5, "1": 3}
    assert resume_state(cfg(1), str(legacy))["data_position"] == {}
