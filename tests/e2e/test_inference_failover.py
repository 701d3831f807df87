"""End-to-end: with two inference workers, `kill -9` of one in the middle of the run does not stop the run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.waiting import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = os.path.join(ROOT, "training", "main_async_ppo.py")


def read_metrics(run_dir: str) -> list[dict]:
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def role_pids(run_dir: str, role: str, index: int) -> list[int]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if ("arl.launch.role" in argv and run_dir in argv and f"--role" in argv
                and argv[argv.index("--role") + 1] == role and argv[argv.index("--index") + 1] == str(index)):
            out.append(int(pid))
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_killing_one_of_two_inference_workers_mid_run_does_not_stop_it(tmp_path):
    from arl.models.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    # a random tiny model (no warm-up: this test is about the run going on, not about learning); its groups are
    # all wrong, so uniform groups are kept instead of filtered
    tok = build_char_tokenizer()
    model_dir = save_model_dir(build_tiny_model(len(tok), seed=0), tok, str(tmp_path / "model"))
    steps = 5
    run_root = str(tmp_path / "runs")
    run_dir = os.path.join(run_root, "run")
    cmd = [sys.executable, MAIN, f"run_dir={run_root}", "run_name=run", f"model.path={model_dir}",
           f"total_train_steps={steps}", "inference.num_workers=2", "learner.batch_size=2", "agent.group_size=4",
           "rollout.max_concurrent_rollouts=8", "eval.max_prompts=16", "eval.every_n_steps=0", "progress=false",
           "startup_timeout=400", "agent.args.filter_uniform_groups=false",
           "inference.restart_on_failure=false"]  # fail-over alone (restarts: tests/faults/test_inference_restart.py)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 700
        while not any(m.get("type") == "train" for m in read_metrics(run_dir)):
            assert proc.poll() is None, f"run ended before its first step: {proc.communicate()[1][-3000:]}"
            assert time.monotonic() < deadline, "no training step within 700 s"
            time.sleep(0.2)
        victims = role_pids(run_dir, "inference", 1)
        assert len(victims) == 1, victims
        os.kill(victims[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=700)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{err[-5000:]}"
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics if m["type"] == "train"] == list(range(1, steps + 1))
    lost = [m for m in metrics if m["type"] == "worker_lost"]
    assert len(lost) == 1 and lost[0]["servers"] == [1] and lost[0]["remaining"] == [0], lost
    evals = [m for m in metrics if m["type"] == "eval"]
    assert evals[-1]["version"] == steps and not evals[-1]["errors"] and evals[-1]["token_versions"] == [steps, steps]
    with open(os.path.join(run_dir, "logs", "rollout0.log")) as f:
        assert "inference worker 1 lost" in f.read()
    wait_until(lambda: role_pids(run_dir, "inference", 0) == [] and role_pids(run_dir, "learner", 0) == [], 30,
               "the roles to exit")
