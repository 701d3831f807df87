"""What the adapters' end-to-end tests share: a short run on the tiny model with the env-chat agent, and the
checks that its train records carry the env's rewards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.e2e.test_end_to_end import SMALL, assert_clean_run, read_metrics, run_main

STEPS = 3  # x batch_size 2 x group_size 4 trajectories of up to max_turns env steps: 20+ env steps


def run_adapter(tmp_path, cache: str, args: list[str], steps: int = STEPS) -> tuple[str, list[dict]]:
    proc, run_dir = run_main([f"total_train_steps={steps}", "agent.name=env-chat", *SMALL, *args], str(tmp_path),
                             cache, timeout=600)
    train = assert_clean_run(proc, run_dir, steps)
    return run_dir, train


def env_steps_and_rewards(train: list[dict]) -> tuple[float, list[float]]:
    """(env steps taken, the mean rewards) over the train records' rollout means."""
    rollouts = [m["rollout"] for m in train if m.get("rollout")]
    assert rollouts, [m.keys() for m in train]
    steps = sum(r["turns"] * r["n_traj"] for r in rollouts)
    return steps, [r["reward"] for r in rollouts]


def traces(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "traces.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f]


def refused(args: list[str]) -> subprocess.CompletedProcess:
    """A run with `args` that must be refused before any process starts."""
    main = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "training",
                        "main_async_ppo.py")
    return subprocess.run([sys.executable, main, *args], capture_output=True, text=True, timeout=120)


__all__ = ["run_adapter", "env_steps_and_rewards", "traces", "refused", "read_metrics"]
