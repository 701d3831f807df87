"""An inference worker that stops answering (SIGSTOP) is found by its heartbeat timeout, not by a hang: it is named
with what it was last doing, its stacks are dumped into its log, and then, as configured, the run goes on with the
other worker (inference.tolerate_worker_loss) or a restarted one, or, with no server left and no restart, stops
cleanly."""

from __future__ import annotations

import os
import signal

import pytest

from .harness import (Hold, assert_accounting, assert_no_leftovers, finish, log_text, read_metrics, record,
                      role_pids, start_run, summary, train_steps, wait_for)

STEPS = 4


@pytest.mark.slow
def test_stopped_inference_worker_is_dropped_and_the_run_goes_on(tmp_path, model_cache):
    # held at step 2 until the silent worker was handled: on a fast machine the other worker alone would finish
    # the run within the heartbeat timeout, before the investigation (and its stack dump) is done
    hold = Hold(str(tmp_path), hold_from=2)
    proc, run_dir = start_run(str(tmp_path), model_cache, ["inference.num_workers=2", "inference.heartbeat_timeout=5",
                                                           f"total_train_steps={STEPS}", *hold.args], env=hold.env)
    wait_for(lambda: len(train_steps(run_dir)) >= 1, proc, what="the first step")
    os.kill(role_pids(run_dir)["inference1"], signal.SIGSTOP)
    wait_for(lambda: any(m.get("type") == "worker_lost" for m in read_metrics(run_dir)), proc, timeout=120,
             what="the silent worker to be dropped")
    hold.release()
    code, _, err = finish(proc)
    assert code == 0, err[-6000:]
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    assert "role inference1 sent no heartbeat" in err and "last waiting on: " in err
    assert "Python stacks of inference1" in err and "process state T" in err
    assert "most recent call first" in log_text(run_dir, "inference1")
    s = summary(run_dir)
    fault, restart = s["faults"]  # named and dumped, then dropped and restarted (inference.restart_on_failure)
    assert restart["kind"] == "inference_restart" and restart["servers"] == [1]
    assert fault["role"] == "inference1" and fault["process_state"] == "T" and fault["stacks_dumped"]
    assert [m["process"] for m in read_metrics(run_dir) if m.get("type") == "worker_lost"] == ["inference1"]
    assert_accounting(s)
    assert_no_leftovers(run_dir)
    record("test_inference_silent[goes_on]", "SIGSTOP one of two inference workers", 1, run_dir, True, crashes=0)


@pytest.mark.slow
def test_stopped_only_inference_worker_stops_the_run_cleanly(tmp_path, model_cache):
    # without restarts (a lone server that is restarted is a restart like any other: test_supervision.py)
    proc, run_dir = start_run(str(tmp_path), model_cache, ["inference.heartbeat_timeout=5", "total_train_steps=1000",
                                                           "inference.restart_on_failure=false"])
    wait_for(lambda: len(train_steps(run_dir)) >= 1, proc, what="the first step")
    os.kill(role_pids(run_dir)["inference0"], signal.SIGSTOP)
    code, _, err = finish(proc, timeout=120)
    assert code == 1
    assert "run failed: role inference0 sent no heartbeat" in err and "last waiting on: " in err
    assert "its stacks are dumped in" in err and "most recent call first" in log_text(run_dir, "inference0")
    s = summary(run_dir)
    assert not s["finished"] and s["faults"][0]["role"] == "inference0"
    assert_no_leftovers(run_dir)
    record("test_inference_silent[stops]", "SIGSTOP the only inference worker", 1, run_dir, False, crashes=0,
           stopped_cleanly=True)
