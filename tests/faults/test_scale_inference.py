"""`python -m arl.ctl <run> scale` on the default run: +2, -1, +1 inference servers while it trains. Each joining
server loads the newest weights before the rollout worker routes to it, the leaving one is drained, and the run
finishes with nothing accepted lost."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .harness import (ROOT, Hold, assert_accounting, assert_no_leftovers, finish, read_metrics, record, start_run,
                      summary, train_steps, wait_for)

STEPS = 5


def ctl(run_dir: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arl.ctl", run_dir, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def joined(run_dir: str) -> set[int]:
    return {m["server"] for m in read_metrics(run_dir) if m["type"] == "worker_back"}


@pytest.mark.slow
def test_scale_inference_up_down_up_mid_run(tmp_path, model_cache):
    hold = Hold(str(tmp_path), hold_from=2)  # the run trains past step 2 only once the fleet changes are done
    proc, run_dir = start_run(str(tmp_path), model_cache, [f"total_train_steps={STEPS}", "inference.drain_timeout_s=30",
                                                           *hold.args], env=hold.env)
    wait_for(lambda: len(train_steps(run_dir)) >= 1, proc, what="the first step")
    bad = ctl(run_dir, "scale", "inference=-1")  # the only server: refused, the run untouched
    assert bad.returncode == 1 and "at least one" in bad.stdout, bad.stdout + bad.stderr
    up = ctl(run_dir, "scale", "inference=+2")
    assert up.returncode == 0 and "started servers [1, 2]" in up.stdout, up.stdout + up.stderr
    wait_for(lambda: joined(run_dir) >= {1, 2}, proc, timeout=300, what="servers 1 and 2 to join")
    down = ctl(run_dir, "scale", "inference=-1")
    assert down.returncode == 0 and "drained and stopped servers [2]" in down.stdout, down.stdout + down.stderr
    up = ctl(run_dir, "scale", "inference=+1")
    assert up.returncode == 0 and "started servers [3]" in up.stdout, up.stdout + up.stderr
    wait_for(lambda: 3 in joined(run_dir), proc, timeout=300, what="server 3 to join")
    hold.release()
    code, _, err = finish(proc)
    assert code == 0, err[-6000:]
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    metrics = read_metrics(run_dir)
    assert [m["change"] for m in metrics if m["type"] == "scale"] == [2, -1, 1]
    final = [m for m in metrics if m["type"] == "eval"][-1]["roles"]
    client = final["rollout0"]["client"]
    # each server joined with the newest weights published before it joined, and served requests
    published = 0
    for m in metrics:
        if m["type"] == "train":
            published = max(published, m["version"])
        elif m["type"] == "worker_back":
            assert m["version"] >= published, (m, published)
    assert client["back_w1"] == client["back_w2"] == client["back_w3"] == 1, client
    assert client["sent_w1"] > 0 and client["sent_w3"] > 0 and client["workers_draining"] == 1, client
    assert "inference2" not in final
    s = summary(run_dir)
    assert s["inference_restarts"] == 0
    assert_accounting(s)
    assert_no_leftovers(run_dir)
    gone = ctl(run_dir, "scale", "inference=+1")  # the run has ended
    assert gone.returncode == 2 and "not running" in gone.stderr, gone.stderr
    record("test_scale_inference", "scale inference +2 / -1 / +1 mid-run", 0, run_dir, True)
