"""kill -9 of one of two inference workers with `inference.restart_on_failure` (the default): its requests go to
the other worker at once, the controller starts it again, the new process loads the newest weights and rejoins the
routing, and the run finishes every step with nothing accepted lost."""

from __future__ import annotations

import os
import signal

import pytest

from .harness import (Hold, assert_accounting, assert_no_leftovers, finish, read_metrics, record, role_pids,
                      start_run, summary, train_steps, wait_for)

STEPS = 6


@pytest.mark.slow
def test_killed_inference_worker_is_restarted_and_rejoins(tmp_path, model_cache):
    hold = Hold(str(tmp_path), hold_from=2)  # the run waits at step 2 until the restarted worker is back
    proc, run_dir = start_run(str(tmp_path), model_cache, ["inference.num_workers=2", f"total_train_steps={STEPS}",
                                                           *hold.args], env=hold.env)
    wait_for(lambda: len(train_steps(run_dir)) >= 1, proc, what="the first step")
    old = role_pids(run_dir)["inference1"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: any(m.get("type") == "worker_back" for m in read_metrics(run_dir)), proc, timeout=300,
             what="the restarted inference worker to rejoin")
    assert role_pids(run_dir)["inference1"] != old
    hold.release()
    code, _, err = finish(proc)
    assert code == 0, err[-6000:]
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    metrics = read_metrics(run_dir)
    kinds = [(m["type"], m.get("servers") or m.get("server")) for m in metrics
             if m["type"] in ("worker_lost", "worker_restarted", "worker_back")]
    assert kinds == [("worker_lost", [1]), ("worker_restarted", [1]), ("worker_back", 1)], kinds
    s = summary(run_dir)
    assert s["inference_restarts"] == 1
    # the rollout worker routed to the new process: requests sent to worker 1 since it came back (fresh counters,
    # sent with the final evaluation)
    client = [m for m in metrics if m["type"] == "eval"][-1]["roles"]["rollout0"]["client"]
    assert client["back_w1"] == 1 and client["sent_w1"] > 0, client
    assert "inference server 1 is back" in err
    assert_accounting(s)
    assert_no_leftovers(run_dir)
    record("test_inference_restart", "kill -9 one of two inference workers (restarted)", 1, run_dir, True, crashes=0)
