"""Recorded batches (`learner.record_batches`): the file format round trip, the recorder, the worker's hook."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest

from arl.api.types import Trajectory
from arl.config import ConfigError, ExperimentConfig, validate
from arl.learner.record import (
    MANIFEST_FILE,
    BatchRecorder,
    batch_path,
    decode_batch,
    encode_batch,
    read_batch,
    read_manifest,
    recorded_versions,
    replay_settings,
    settings_diff,
    settings_hash,
    write_batch,
)
from arl.learner.worker import LearnerWorker

from ..typed_control import typed


def _traj(rng: np.random.Generator, gid: str, **kw) -> Trajectory:
    n = int(rng.integers(3, 12))
    mask = (rng.random(n) < 0.6).astype(np.int8)
    return Trajectory(input_ids=rng.integers(0, 150_000, n), loss_mask=mask,
                      logprobs=np.where(mask, rng.normal(-1, 1, n), 0).astype(np.float32),
                      versions=np.where(mask, rng.integers(0, 9, n), -1), reward=float(rng.normal()), group_id=gid,
                      **kw)


def _batch() -> list[Trajectory]:
    rng = np.random.default_rng(3)
    return [
        _traj(rng, "w0-a-1:g"),
        _traj(rng, "w0-a-1:g", turn_rewards=[0.25, 1.0 / 3.0], turn_discount=0.0),
        _traj(rng, "w1-b-7:ü", turn_rewards=[1e-30], turn_discount=0.9, metadata={"prompt_pos": [1, 7]}),
        _traj(rng, "w1-b-8:g", policy_spans=[("white", 0, 1), ("black", 2, 3)],
              policy_rewards={"white": 1.0, "black": -1.0}),  # several policies: spans and rewards kept
        Trajectory(input_ids=np.zeros(0), loss_mask=np.zeros(0), logprobs=np.zeros(0), versions=np.zeros(0),
                   reward=-0.1, group_id="empty"),
    ]


def _same(a: Trajectory, b: Trajectory) -> None:
    for name in ("input_ids", "loss_mask", "logprobs", "versions"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name  # bit for bit, dtype included
    assert (a.reward, a.group_id, a.turn_rewards, a.turn_discount) == (b.reward, b.group_id, b.turn_rewards,
                                                                       b.turn_discount)
    assert (a.policy_spans, a.policy_rewards) == (b.policy_spans, b.policy_rewards)


def test_batch_round_trip_is_exact(tmp_path):
    batch = _batch()
    back = decode_batch(encode_batch(5, batch, "abc"))
    assert back.version == 5 and back.config_hash == "abc" and len(back.trajs) == len(batch)
    for a, b in zip(batch, back.trajs):
        _same(a, b)
    path = write_batch(str(tmp_path), 5, batch, "abc")
    assert path == batch_path(str(tmp_path), 6) and path.endswith("v6.npz")  # the batch that made v6
    disk = read_batch(path)
    assert disk.version == 5 and [t.group_id for t in disk.trajs] == [t.group_id for t in batch]  # order kept
    for a, b in zip(batch, disk.trajs):
        _same(a, b)
    assert recorded_versions(str(tmp_path)) == [6]
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]  # written through a temporary file


def test_a_batch_recorded_before_several_policies_reads_as_the_runs_own_policy():
    arrays = encode_batch(2, _batch())
    old = {k: v for k, v in arrays.items() if not k.startswith(("span_", "preward_"))}
    back = decode_batch(old)
    assert all(t.policy_spans == [] and t.policy_rewards == {} for t in back.trajs)


def test_a_file_of_another_format_is_refused():
    arrays = encode_batch(0, _batch())
    arrays["format"] = np.array(99)
    with pytest.raises(ValueError, match="format 99"):
        decode_batch(arrays)


def test_settings_name_what_differs():
    cfg = ExperimentConfig()
    a = replay_settings(cfg)
    cfg.learner.optimizer.lr = 5e-4
    cfg.learner.keep_checkpoints = 9  # operational: a replay does not care
    cfg.learner.record_batches = True
    b = replay_settings(cfg)
    assert settings_hash(a) != settings_hash(b)
    assert settings_diff(a, b) == ["learner.optimizer.lr: 0.0001 -> 0.0005"]
    cfg.learner.optimizer.lr = 1e-4
    assert settings_hash(replay_settings(cfg)) == settings_hash(a)


def test_recorder_writes_manifest_and_batches_and_forgets_after_a_resume(tmp_path):
    d = str(tmp_path / "batches")
    settings = replay_settings(ExperimentConfig())
    rec = BatchRecorder(d, settings, threads=3)
    for v in range(4):
        rec.record(v, _batch())
    rec.flush()
    assert recorded_versions(d) == [1, 2, 3, 4] and rec.steps == 4
    assert rec.bytes_written == sum(os.path.getsize(batch_path(d, v)) for v in (1, 2, 3, 4))
    man = read_manifest(d)
    assert man["threads"] == 3 and man["configs"] == {rec.config_hash: settings}
    assert read_batch(batch_path(d, 3)).config_hash == rec.config_hash
    rec.forget_after(2)
    assert recorded_versions(d) == [1, 2]
    rec.close()
    other = dict(settings, seed=7)  # a recover=auto run under another config adds its settings
    BatchRecorder(d, other, threads=3).close()
    with open(os.path.join(d, MANIFEST_FILE)) as f:
        assert len(json.load(f)["configs"]) == 2


def test_a_failed_write_surfaces_at_the_next_record(tmp_path):
    d = str(tmp_path / "batches")
    rec = BatchRecorder(d, {}, threads=1)
    os.makedirs(batch_path(d, 1))  # a folder where the batch file must go: the rename onto it fails
    rec.record(0, _batch())
    with pytest.raises(OSError):
        rec.record(1, _batch())
    rec.close()  # nothing left pending: the failed step's batch was not queued (the learner stops on the error)
    assert not os.path.exists(batch_path(d, 2))


class _Actor:
    """The actor's four phases, recording what `prepare` got (no model)."""

    def __init__(self) -> None:
        self.version = 0
        self.engine = self
        self.world_size = 1
        self.seen: list[list[str]] = []

    def prepare(self, trajs):
        self.seen.append([t.group_id for t in trajs])
        return trajs

    def compute_logp(self, batch):
        pass

    def compute_advantages(self, batch):
        pass

    def ppo_update(self, batch):
        self.version += 1
        return {}

    def export_weights(self, path):
        with open(path, "wb") as f:
            f.write(b"w")


async def _noop(msg_type, payload) -> None:
    pass


def test_the_worker_records_each_batch_as_the_actor_gets_it(tmp_path):
    rng = np.random.default_rng(0)
    groups = [[_traj(rng, f"w0-x-{g}:{k}") for k in range(2)] for g in range(6)]
    actor = _Actor()
    rec = BatchRecorder(str(tmp_path / "batches"), {}, threads=1)
    w = LearnerWorker(actor=actor, pull=None, send_control=typed(_noop), batch_size=2, total_steps=3,
                      weights_dir=str(tmp_path / "weights"), recorder=rec)
    w.buffer.extend(groups)
    asyncio.run(w.train())
    assert recorded_versions(rec.dir) == [1, 2, 3]  # the last one is on disk when train() returns
    for v in (1, 2, 3):
        b = read_batch(batch_path(rec.dir, v))
        assert b.version == v - 1 and [t.group_id for t in b.trajs] == actor.seen[v - 1]
        for a, c in zip([t for g in groups[2 * (v - 1):2 * v] for t in g], b.trajs):
            _same(a, c)
    rec.close()


def test_a_sim_run_records_what_it_trained_but_cannot_be_replayed(tmp_path):
    """A sim learner's batches say which prompts a run trained (scripts/kill_resume.py reads them); a replay or a
    re-score of such a run is refused by name, before anything is loaded."""
    from arl.cli import load_config
    from arl.config import to_yaml
    from arl.replay import ReplayError, ReplayRun
    from experiments import MODULES

    cfg = load_config(["learner.backend=sim", "learner.record_batches=true"], MODULES)  # valid
    (tmp_path / "config.yaml").write_text(to_yaml(cfg))
    with pytest.raises(ReplayError, match="learner.backend=sim, which trains no model"):
        ReplayRun.open(str(tmp_path))


def test_recording_off_writes_nothing(tmp_path):
    actor = _Actor()
    rng = np.random.default_rng(0)
    w = LearnerWorker(actor=actor, pull=None, send_control=typed(_noop), batch_size=1, total_steps=1,
                      weights_dir=str(tmp_path / "weights"))
    w.buffer.append([_traj(rng, "w0-x-0:0")])
    asyncio.run(w.train())
    assert w.recorder is None and sorted(os.listdir(tmp_path)) == ["weights"]


def test_a_batch_keeps_each_trajectorys_prompt_position(tmp_path):
    from arl.learner.record import read_batch, write_batch

    trajs = [Trajectory(input_ids=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0, -1.0, -1.0], versions=[-1, 0, 0],
                        reward=1.0, group_id=f"w0.ag{i}:0", metadata={"prompt_pos": [1, 40 + i]} if i else {})
             for i in range(3)]
    back = read_batch(write_batch(str(tmp_path), 0, trajs)).trajs
    assert [t.metadata.get("prompt_pos") for t in back] == [None, [1, 41], [1, 42]]
