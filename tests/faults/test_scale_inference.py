"""`python -m arl.ctl <run> scale` on the default run (envs on an env server): +2, -1, +1 inference servers and +1, -1
rollout workers and env servers while it trains. Each joining server loads the newest weights before the rollout
workers route to it, the leaving one is drained; the joining rollout worker trains groups of a prompt stream of its
own, and when it leaves its running groups finish (accepted) and its stream goes on at rollout0; the joining env
server takes sessions, the leaving one is drained of them; the run finishes with nothing accepted lost."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from .harness import (ROOT, Hold, assert_accounting, assert_no_leftovers, finish, launcher_log, read_metrics, record,
                      start_run, summary, train_steps, wait_for)

STEPS = 11


def ctl(run_dir: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "arl.ctl", run_dir, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=env)


def joined(run_dir: str, role: str = "inference") -> set[int]:
    return {m["server"] for m in read_metrics(run_dir) if m["type"] == "worker_back" and m["role"] == role}


@pytest.mark.slow
def test_scale_inference_up_down_up_mid_run(tmp_path, model_cache):
    # the run trains past versions 2, 5 and 8 only once the test says so (releases 0, 1, 2); rollout1's groups
    # wait for release 3 instead
    hold = Hold(str(tmp_path), hold_from=(2, 5, 8), hold_process="rollout1=3")
    # env.drain_timeout_s: a group rollout0 started at version 8 may have its sessions on env server 1 before that
    # one drains, held until the end; the drain then closes them with the server after its timeout (dropped, counted)
    args = [f"total_train_steps={STEPS}", "inference.drain_timeout_s=30", "env.drain_timeout_s=15", "env.servers=1",
            *hold.args]
    proc, run_dir = start_run(str(tmp_path), model_cache, args, env=hold.env)
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
    up = ctl(run_dir, "scale", "rollout=+1", "env=+1")
    assert up.returncode == 0 and "started rollout workers [1]" in up.stdout, up.stdout + up.stderr
    assert "started env servers [1]" in up.stdout, up.stdout
    wait_for(lambda: "rollout1: registered" in log_of(run_dir, "rollout1") and 1 in joined(run_dir, "env"), proc,
             timeout=300, what="rollout1 and env server 1 to join")
    # the gate has rollout1's request before it moves: the groups it admits from now on go to the two in turn
    wait_for(lambda: "admission: rollout1 asks" in launcher_log(proc), proc, what="rollout1 to ask the gate")
    hold.release(0)
    wait_for(lambda: hold.held("rollout1"), proc, timeout=300, what="a group running on rollout1")
    # rollout1 is drained while its held groups run; they finish once released (the run cannot pass version 5)
    down = subprocess.Popen([sys.executable, "-m", "arl.ctl", run_dir, "scale", "rollout=-1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: "leaving the run" in log_of(run_dir, "rollout1"), proc, what="rollout1 to drain")
    hold.release(3)
    out, err = down.communicate(timeout=300)
    assert down.returncode == 0 and "drained and stopped rollout workers [1]" in out, out + err
    assert "streams [1] to rollout0" in out and int(re.search(r"accepted there: \{1: (\d+)\}", out)[1]) > 0, out
    # env server 1 is drained while held groups have sessions there: they end once released (to version 8)
    down = subprocess.Popen([sys.executable, "-m", "arl.ctl", run_dir, "scale", "env=-1"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: "env server 1 leaves the run" in log_of(run_dir, "rollout0"), proc, what="env server 1 to drain")
    hold.release(1)
    out, err = down.communicate(timeout=300)
    assert down.returncode == 0, out + err
    assert int(re.search(r"drained and stopped env servers \[1\] .*opened: \{1: (\d+)\}", out)[1]) > 0, out
    hold.release(2)
    code, _, err = finish(proc)
    assert code == 0, err[-6000:]
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    metrics = read_metrics(run_dir)
    assert [(m["role"], m["change"]) for m in metrics if m["type"] == "scale"] == [
        ("inference", 2), ("inference", -1), ("inference", 1), ("rollout", 1), ("env", 1), ("rollout", -1),
        ("env", -1)]
    final = [m for m in metrics if m["type"] == "eval"][-1]["roles"]
    client = final["rollout0"]["client"]
    # each server joined with the newest weights published before it joined, and served requests
    published = 0
    for m in metrics:
        if m["type"] == "train":
            published = max(published, m["version"])
        elif m["type"] == "worker_back" and m["role"] == "inference":
            assert m["version"] >= published, (m, published)
    assert client["back_w1"] == client["back_w2"] == client["back_w3"] == 1, client
    assert client["sent_w1"] > 0 and client["sent_w3"] > 0 and client["workers_draining"] == 1, client
    assert "inference2" not in final  # (the final evaluation may come before rollout1's drain has ended)
    assert "adopted prompt streams [1]" in log_of(run_dir, "rollout0")  # it draws the stream rollout1 left
    s = summary(run_dir)
    assert s["inference_restarts"] == 0
    assert_accounting(s)
    assert_no_leftovers(run_dir)
    gone = ctl(run_dir, "scale", "inference=+1")  # the run has ended
    assert gone.returncode == 2 and "not running" in gone.stderr, gone.stderr
    record("test_scale_inference", "scale inference +2 / -1 / +1, rollout +1 / -1 mid-run", 0, run_dir, True)


def log_of(run_dir: str, process: str) -> str:
    try:
        with open(f"{run_dir}/logs/{process}.log") as f:
            return f.read()
    except FileNotFoundError:
        return ""
