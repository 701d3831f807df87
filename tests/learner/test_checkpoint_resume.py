"""Checkpoint every N steps and resume: 4 steps straight == 2 steps, crash, recover, 2 more (bit for bit)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from arl.data.position import DataPosition
import torch

pytest.importorskip("deepspeed")

from safetensors.torch import load_file  # noqa: E402

from arl.learner.checkpoint import CHECKPOINT_STATE_FILE, latest_checkpoint, read_checkpoint_state  # noqa: E402
from arl.learner.worker import LearnerWorker  # noqa: E402

from ..typed_control import typed  # noqa: E402

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _train_fixed as tf  # noqa: E402


class Args:
    zero_stage = 0
    steps = 4
    max_tokens_per_mb = 40


async def _noop(msg_type: str, payload: dict) -> None:
    pass


def _worker(lrn, tmp, total, every=0, ckpt=None):
    return LearnerWorker(actor=lrn, pull=None, send_control=typed(_noop), batch_size=tf.BATCH, total_steps=total,
                         weights_dir=str(tmp / "weights"), checkpoint_dir=ckpt, checkpoint_every=every)


def _weights(lrn):
    return {k: v.detach().clone() for k, v in lrn.engine.module.state_dict().items()}


def test_resume_in_process_matches_straight_run(tmp_path):
    groups = tf.make_groups(4 * tf.BATCH)
    straight = tf.make_learner(Args())
    w = _worker(straight, tmp_path / "a", total=4)
    w.buffer.extend(groups)
    asyncio.run(w.train())
    assert straight.version == 4

    ckpt = str(tmp_path / "ckpt")
    first = tf.make_learner(Args())
    w1 = _worker(first, tmp_path / "b", total=2, every=2, ckpt=ckpt)
    w1.buffer.extend(groups)
    asyncio.run(w1.train())
    assert latest_checkpoint(ckpt).endswith("v2")
    state = read_checkpoint_state(ckpt)
    counters = state.pop("counters")
    assert state.pop("received_group_ids") == {"bits": {}, "other": []}  # put in the buffer, not received
    assert state == {"version": 2, "groups_consumed": 8, "data_position": {"0": {"low": 8, "above": []}},
                     "prompt_shards": 1, "batch_size": tf.BATCH}
    assert counters["stale_groups_dropped"] == 0 and counters["steps"] == 2
    w1.stats["stale_groups_dropped"] = 99  # not in the checkpoint: must not survive the crash
    del first, w1

    resumed = tf.make_learner(Args())  # fresh weights, optimizer, scheduler
    w2 = _worker(resumed, tmp_path / "c", total=4, every=2, ckpt=ckpt)
    assert asyncio.run(w2.resume()) == 2
    assert resumed.version == 2 and w2.groups_consumed == 8 and w2.data_position == {"0": DataPosition(8)}
    assert w2.stats["stale_groups_dropped"] == 0
    assert os.path.exists(tmp_path / "c" / "weights" / "v2.safetensors")  # for the inference workers
    w2.buffer.extend(groups[w2.data_position["0"].low:])
    asyncio.run(w2.train())
    assert resumed.version == 4
    a, b = _weights(straight), _weights(resumed)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # the LR schedule resumed too (cosine over 4 steps with 1 warm-up step)
    assert resumed.engine.optimizer.param_groups[0]["lr"] == straight.engine.optimizer.param_groups[0]["lr"]
    assert latest_checkpoint(ckpt).endswith("v4") and sorted(os.listdir(ckpt)) == ["latest", "v2", "v4"]


def test_no_checkpoint_means_fresh_start(tmp_path):
    lrn = tf.make_learner(Args())
    w = _worker(lrn, tmp_path, total=1, every=1, ckpt=str(tmp_path / "none"))
    assert asyncio.run(w.resume()) is None and lrn.version == 0
    assert read_checkpoint_state(str(tmp_path / "none")) is None


def test_keep_last_prunes_and_state_file_is_written_before_latest(tmp_path):
    lrn = tf.make_learner(Args())
    ckpt = str(tmp_path / "ck")
    groups = tf.make_groups(3 * tf.BATCH)
    w = LearnerWorker(actor=lrn, pull=None, send_control=typed(_noop), batch_size=tf.BATCH, total_steps=3,
                      weights_dir=str(tmp_path / "w"), checkpoint_dir=ckpt, checkpoint_every=1, keep_checkpoints=2)
    w.buffer.extend(groups)
    asyncio.run(w.train())
    assert sorted(os.listdir(ckpt)) == ["latest", "v2", "v3"]
    with open(os.path.join(ckpt, "v3", CHECKPOINT_STATE_FILE)) as f:
        assert json.load(f)["version"] == 3
    # a save cut short after the state file but before `latest`: the previous checkpoint is still the one used
    os.makedirs(os.path.join(ckpt, "v9"))
    with open(os.path.join(ckpt, "v9", CHECKPOINT_STATE_FILE), "w") as f:
        json.dump({"version": 9}, f)
    assert read_checkpoint_state(ckpt)["version"] == 3


def _env():
    """This process's environment without the distributed variables an in-process learner set (a child would
    otherwise try to bind the same MASTER_PORT)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(args, timeout=300):
    return subprocess.run([sys.executable, os.path.join(HERE, "_train_fixed.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=_env())


@pytest.mark.slow
def test_kill_and_recover_in_new_processes(tmp_path):
    """4 steps straight vs 2 steps + SIGKILL + a new process that recovers from the latest checkpoint."""
    straight = str(tmp_path / "straight.safetensors")
    r = _run(["--out", straight, "--steps", "4"])
    assert r.returncode == 0, r.stdout + r.stderr

    ckpt, first = str(tmp_path / "ckpt"), str(tmp_path / "first.safetensors")
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "_train_fixed.py"), "--out", first, "--steps", "4",
                          "--ckpt", ckpt, "--checkpoint-every", "2", "--hang-after", "2"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=_env())
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(first + ".ready"):
            assert p.poll() is None, "trainer exited early"
            assert time.monotonic() < deadline, "trainer did not reach step 2"
            time.sleep(0.2)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)

    resumed = str(tmp_path / "resumed.safetensors")
    r = _run(["--out", resumed, "--steps", "4", "--ckpt", ckpt, "--checkpoint-every", "2", "--resume"])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resumed at version 2, 8 groups consumed" in r.stdout
    a, b, mid = load_file(straight), load_file(resumed), load_file(first)
    assert any(not torch.equal(a[k], mid[k]) for k in a)  # the crash really was mid-run
    for k in a:
        assert torch.equal(a[k], b[k]), k
