"""End-to-end: a run with two learner ranks (torchrun, gloo) checkpoints, stops, and `recover=auto` resumes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from arl.data.position import DataPosition

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = os.path.join(ROOT, "training", "main_async_ppo.py")
SMALL = ["learner.batch_size=2", "agent.group_size=4", "rollout.max_concurrent_rollouts=8", "eval.max_prompts=16",
         "eval.every_n_steps=0", "progress=false", "startup_timeout=240", "learner.num_ranks=2",
         "learner.checkpoint_every=2",
         "model.warmup_max_steps=5",  # no need for a good model here: keep the (uncached) warm-up short
         # so that a weak model's all-wrong groups still train: the math agent filters them itself by default
         # (the resumed run once failed on 200 groups in a row dropped as 'filtered' with only the rollout's off)
         "rollout.filter_uniform_groups=false", "agent.args.filter_uniform_groups=false"]


def _run(args, run_root, cache, timeout=500):
    cmd = [sys.executable, MAIN, f"run_dir={run_root}", "run_name=run", f"model.cache_dir={cache}", *SMALL, *args]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _records(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_two_learner_ranks_checkpoint_and_recover(tmp_path):
    cache, root = str(tmp_path / "cache"), str(tmp_path / "runs")
    run_dir = os.path.join(root, "run")
    first = _run(["total_train_steps=2"], root, cache)
    assert first.returncode == 0, first.stderr[-4000:]
    log = open(os.path.join(run_dir, "logs", "learner.log")).read()
    assert "learner0-rank1" in log and "rank 1: stop after 2 steps" in log
    with open(os.path.join(run_dir, "checkpoints", "v2", "arl_state.json")) as f:
        state = json.load(f)
    done = DataPosition.from_state(state["data_position"]["0"])
    assert state["version"] == 2 and state["groups_consumed"] == 4 and len(done) >= 4  # trained, or rule-dropped

    second = _run(["total_train_steps=4", "recover=auto"], root, cache)
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resuming at version 2" in second.stderr + second.stdout
    log = open(os.path.join(run_dir, "logs", "learner.log")).read()
    assert "resumed from checkpoint v2 (4 groups consumed" in log and "rank 1: stop after 2 steps" in log
    rollout = open(os.path.join(run_dir, "logs", "rollout0.log")).read()
    redrawn = len(list(done.unsettled(done.next_fresh)))
    assert f"prompt streams resume: {redrawn} prompts drawn again, then positions {{0: {done.next_fresh}}}" in rollout
    recs = _records(run_dir)
    steps = [r["step"] for r in recs if r["type"] == "train"]
    assert steps == [1, 2, 3, 4]  # the resumed run went on from version 2, no step repeated
    evals = [r["step"] for r in recs if r["type"] == "eval"]
    assert evals == [0, 2, 2, 4]  # start, end of the first run, start of the resumed run, end
