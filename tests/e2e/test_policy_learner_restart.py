"""End-to-end: the learner of a trainable listed policy (`learner1`, `experiment=self-play-rivals`) is killed
(SIGKILL) after a checkpoint; the controller restarts it from its own checkpoint while the run's learner, the
inference and the rollout processes keep running, every server goes back to that version of the policy, and the
run finishes with both policies trained to the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.e2e.test_end_to_end import MAIN, ROOT, _worker_pids, leftover_processes, model_cache, \
    read_metrics  # noqa: F401
from tests.waiting import wait_until

pytest.importorskip("peft")


def _policy_steps(run_dir: str) -> list[int]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    return [json.loads(line)["version"] for line in open(path) if '"type": "policy_step"' in line]


@pytest.mark.timeout(400)
def test_a_killed_policy_learner_is_restarted_from_its_checkpoint(tmp_path, model_cache):
    run_dir, steps = str(tmp_path / "run"), 10
    cmd = [sys.executable, MAIN, f"run_dir={tmp_path}", "run_name=run", f"model.cache_dir={model_cache}",
           "experiment=self-play-rivals", f"total_train_steps={steps}", "eval.every_n_steps=0", "progress=false",
           "learner.batch_size=4", "learner.checkpoint_every=2", "learner.max_restarts=1"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: proc.poll() is not None or 3 in _policy_steps(run_dir), 300, "the rival's step 3")
        assert proc.poll() is None, proc.communicate()
        os.kill(_worker_pids(run_dir)["learner1"], signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, f"stdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
    assert "learner1 (policy 'rival') died (exited with code -9); restarted from its checkpoint v" in err
    records = read_metrics(run_dir)
    (fault,) = [r for r in records if r.get("kind") == "policy_learner_restart"]
    assert fault["policy"] == "rival" and fault["to_version"] in (2, 4) and fault["restarts"] == 1
    versions = [r["version"] for r in records if r["type"] == "policy_step"]
    assert versions[-1] == steps and fault["to_version"] + 1 in versions[versions.index(3) + 1:]  # went back
    (summary,) = [r for r in records if r["type"] == "summary"]
    assert summary["finished"] and summary["steps"] == steps and summary["learner_restarts"] == 1
    books = summary["policies"]["rival"]
    assert books["version"] == steps and books["trained_twice"] == 0
    assert summary["lost_accepted_groups"] == 0 and summary["learner"]["trained_twice"] == 0
    assert "learner1 is back at" in open(os.path.join(run_dir, "logs", "rollout0.log")).read()
    log = out + err
    assert (log.count("started learner1 (pid"), log.count("started learner (pid")) == (2, 1)
    wait_until(lambda: leftover_processes(run_dir) == [], 30, f"the roles of {run_dir} to exit")
