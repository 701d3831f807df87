"""kill -9 of a rollout worker: the controller restarts it, counts its in-flight groups as lost and returns their
staleness budget (else the run could not admit its last groups), and the run finishes every step."""

from __future__ import annotations

import os
import signal

import pytest

from .harness import (assert_accounting, assert_no_leftovers, finish, read_metrics, record, role_pids, start_run,
                      summary, train_steps, wait_for)

STEPS = 4


@pytest.mark.slow
@pytest.mark.parametrize("agent", [[], ["experiment=openai-math", "rollout.verify_token_ledger=true"]],
                         ids=["queue-agent", "openai-endpoint-agent"])
def test_killed_rollout_worker_is_restarted_and_the_run_finishes(tmp_path, model_cache, agent):
    """Also with an agent written against the OpenAI API: the restarted worker serves a new endpoint."""
    proc, run_dir = start_run(str(tmp_path), model_cache, ["rollout.num_workers=2", f"total_train_steps={STEPS}",
                                                           *agent])
    wait_for(lambda: len(train_steps(run_dir)) >= 1, proc, what="the first step")
    old = role_pids(run_dir)["rollout1"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: role_pids(run_dir).get("rollout1") not in (None, old), proc, what="the restart")
    code, _, err = finish(proc)
    assert code == 0, err[-6000:]
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    s = summary(run_dir)
    assert s["rollout_restarts"] == 1
    (restart,) = [m for m in read_metrics(run_dir) if m.get("type") == "worker_restarted"]
    assert restart["role"] == "rollout1" and "exited with code -9" in restart["reason"]
    assert s["groups"].get("lost_worker_died", 0) == s["lost_in_flight_groups"] == restart["lost_groups"]
    assert "rollout1 exited with code -9; restarted it" in err
    assert_accounting(s)
    assert_no_leftovers(run_dir)
    record("test_rollout_kill" + ("_openai_agent" if agent else ""), "kill -9 a rollout worker"
           + (" (OpenAI-API agent)" if agent else ""), 1, run_dir, True, crashes=0,
           lost_in_flight_groups=s["lost_in_flight_groups"])
