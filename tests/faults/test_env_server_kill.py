"""Env servers (env.servers=2): kill -9 of one mid-run. The controller sees it exit, tells the rollout workers
(its sessions' calls fail at once), restarts it (env.max_restarts); the groups whose episodes lived there are dropped
with a counted reason and their budget returns; nothing accepted is lost and the run finishes every step."""

from __future__ import annotations

import os
import signal

import pytest

from .harness import (assert_accounting, assert_no_leftovers, finish, launcher_log, read_metrics, record, role_pids,
                      start_run, summary, train_steps, wait_for)

STEPS = 40  # long enough for the new env1 to start and register (10-20 s on a loaded machine)


@pytest.mark.slow
def test_killed_env_server_is_restarted_and_its_groups_dropped_with_a_reason(tmp_path, model_cache):
    proc, run_dir = start_run(str(tmp_path), model_cache, ["env.servers=2", f"total_train_steps={STEPS}"])
    wait_for(lambda: len(train_steps(run_dir)) >= 1, proc, what="the first step")
    old = role_pids(run_dir)["env1"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: role_pids(run_dir).get("env1") not in (None, old), proc, what="the restart")
    wait_for(lambda: launcher_log(proc).count("registered env1") == 2, proc, what="the new env1 to register")
    code, _, err = finish(proc)
    assert code == 0, err[-6000:]
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    s = summary(run_dir)
    assert s["env_restarts"] == 1 and s["rollout_restarts"] == 0
    (restart,) = [m for m in read_metrics(run_dir) if m.get("type") == "worker_restarted"]
    assert restart["role"] == "env1" and "exited with code -9" in restart["reason"]
    lost = {r: n for r, n in s["groups"].items() if "EnvServerLost" in r}
    assert lost and all(r.startswith("env_error:") for r in lost), s["groups"]  # dropped, with the reason
    assert set(s["env_servers"]) == {"env0", "env1"}  # both in the accounting (env1: its new incarnation)
    (back,) = [m for m in read_metrics(run_dir) if m.get("type") == "worker_back" and m.get("role") == "env"]
    assert back["server"] == 1  # the rollout workers route new sessions to it again
    assert "env server env1 exited with code -9; restarted it" in err
    assert_accounting(s)
    assert_no_leftovers(run_dir)
    record("test_env_server_kill", "kill -9 one of two env servers", 1, run_dir, True, crashes=0,
           dropped_for_the_lost_server=sum(lost.values()))


@pytest.mark.slow
def test_a_hung_env_server_is_found_by_its_heartbeat_and_restarted(tmp_path, model_cache):
    """SIGSTOP (a server hung in a sync env call looks the same): no heartbeat for env.heartbeat_timeout, so its
    stacks are asked for, it is killed and restarted, and its groups are dropped; the run finishes."""
    proc, run_dir = start_run(str(tmp_path), model_cache, ["env.servers=2", f"total_train_steps={STEPS}",
                                                           "env.heartbeat_timeout=4"])
    wait_for(lambda: len(train_steps(run_dir)) >= 1, proc, what="the first step")
    old = role_pids(run_dir)["env0"]
    os.kill(old, signal.SIGSTOP)
    wait_for(lambda: role_pids(run_dir).get("env0") not in (None, old), proc, what="the restart")
    code, _, err = finish(proc)
    assert code == 0, err[-6000:]
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    s = summary(run_dir)
    assert s["env_restarts"] == 1
    (silent,) = [f for f in s["faults"] if f["kind"] == "heartbeat_timeout"]
    assert silent["role"] == "env0"
    (restart,) = [m for m in read_metrics(run_dir) if m.get("type") == "worker_restarted"]
    assert restart["role"] == "env0" and "sent no heartbeat" in restart["reason"]
    assert_accounting(s)
    assert_no_leftovers(run_dir)
