"""The default experiment with its envs on two env servers (env.servers=2) learns as in-process does."""

from __future__ import annotations

import pytest

from tests.e2e.test_end_to_end import assert_clean_run, read_metrics, run_main, model_cache  # noqa: F401


@pytest.mark.slow
def test_default_experiment_with_two_env_servers_learns(tmp_path, model_cache):  # noqa: F811
    steps = 100
    proc, run_dir = run_main([f"total_train_steps={steps}", "env.servers=2", "eval.every_n_steps=50",
                              "progress=false", "startup_timeout=240"], str(tmp_path), model_cache, timeout=900)
    assert_clean_run(proc, run_dir, steps)
    evals = [m for m in read_metrics(run_dir) if m["type"] == "eval"]
    assert evals[-1]["first_acc"] - evals[0]["first_acc"] >= 0.25, [(e["version"], e["first_acc"]) for e in evals]
    (s,) = [m for m in read_metrics(run_dir) if m["type"] == "summary"]
    assert set(s["env_servers"]) == {"env0", "env1"} and s["lost_accepted_groups"] == 0
    assert all(st["sessions_opened"] > 0 for st in s["env_servers"].values())  # both served sessions
    assert s["env"]["env_calls"] > 0 and not any("env_error" in r for r in s["groups"])
