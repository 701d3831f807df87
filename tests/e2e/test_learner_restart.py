"""End-to-end: the learner is killed (SIGKILL) after a checkpoint; the controller restarts it from that checkpoint
while the inference and rollout processes keep running, and the run finishes by itself with every accepted group
accounted for once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.test_end_to_end import MAIN, ROOT, _worker_pids, leftover_processes, read_metrics
from tests.waiting import wait_until

pytest.importorskip("deepspeed")

SMALL = ["learner.batch_size=2", "agent.group_size=4", "rollout.max_concurrent_rollouts=8", "eval.max_prompts=8",
         "eval.every_n_steps=0", "progress=false", "startup_timeout=240", "total_train_steps=4",
         "learner.checkpoint_every=2", "learner.max_restarts=1", "model.warmup_max_steps=5",
         "rollout.filter_uniform_groups=false", "agent.args.filter_uniform_groups=false"]


def _train_steps(run_dir: str) -> list[int]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line)["step"] for line in open(path) if '"type": "train"' in line]


@pytest.mark.slow
def test_a_killed_learner_is_restarted_from_its_checkpoint_and_the_run_finishes(tmp_path):
    run_dir = str(tmp_path / "run")
    cmd = [sys.executable, MAIN, f"run_dir={tmp_path}", "run_name=run", *SMALL]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # killed after step 3: checkpoint v2 is the newest, step 3's batch and the groups on v3 are lost with it
        wait_until(lambda: proc.poll() is not None or 3 in _train_steps(run_dir), 400, "train step 3")
        assert proc.poll() is None, proc.communicate()
        before = _worker_pids(run_dir)
        os.kill(before["learner0"], signal.SIGKILL)
        out, err = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
    assert "learner died (exited with code -9); restarted from checkpoint v2 (restart 1 of at most 1)" in err
    records = read_metrics(run_dir)
    steps = [r["step"] for r in records if r["type"] == "train"]
    assert steps[:3] == [1, 2, 3] and steps[-2:] == [3, 4]  # v3 trained again after the rollback, then v4
    (fault,) = [r for r in records if r.get("kind") == "learner_restart"]
    assert (fault["from_version"], fault["to_version"], fault["restarts"]) == (3, 2, 1)
    (summary,) = [r for r in records if r["type"] == "summary"]
    assert summary["finished"] and summary["steps"] == 4 and summary["learner_restarts"] == 1
    assert summary["lost_accepted_groups"] == 0 and summary["learner"]["trained_twice"] == 0
    groups = summary["groups"]
    assert groups["lost_learner_restart"] >= 2  # at least step 3's batch
    print("groups by outcome:", groups, "learner:", summary["learner"])
    rollout = open(os.path.join(run_dir, "logs", "rollout0.log")).read()
    assert "the learner is back at" in rollout
    # the learner was started twice; the inference and rollout processes kept running
    log = out + err
    assert (log.count("started learner (pid"), log.count("started inference0 (pid"),
            log.count("started rollout0 (pid")) == (2, 1, 1)
    wait_until(lambda: leftover_processes(run_dir) == [], 30, f"the roles of {run_dir} to exit")
