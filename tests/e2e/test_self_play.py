"""`experiment=self-play` end to end: the tiny model plays Nim against itself (both seats the run's LoRA policy)
and is evaluated against the frozen start (`policies: [{name: start, adapter: base}]`), every role a process.
Whether it learns is measured by the 3-seed figures in docs/benchmarks.md, not here (a short run's rise varies)."""

from __future__ import annotations

import pytest

from tests.e2e.test_end_to_end import assert_clean_run, assert_ledger_checked, model_cache, read_metrics, \
    run_main  # noqa: F401

pytest.importorskip("peft")


@pytest.mark.timeout(300)
def test_self_play_runs_and_evaluates_against_the_frozen_start(tmp_path, model_cache):
    steps = 6
    proc, run_dir = run_main(["experiment=self-play", f"total_train_steps={steps}", "eval.every_n_steps=3",
                              "progress=false", "learner.batch_size=4"], str(tmp_path), model_cache)
    train = assert_clean_run(proc, run_dir, steps)
    assert all(0.0 < m["reward_mean"] < 1.0 for m in train)  # zero-sum: winners and losers in every batch
    evals = [m for m in read_metrics(run_dir) if m["type"] == "eval"]
    assert evals[0]["first_acc"] == 0.5  # the start against itself: each pile won once in its two seat orders
    for ev in evals:
        assert ev["n"] == 32 and not ev["errors"]
        means = ev["traj_means"]
        assert 0 <= means["winning_moves"] <= means["winning_chances"]
        assert ev["roles"]["inference0"]["policies"] == {"start": 0}  # the frozen start is never updated
    assert [m["version"] for m in evals] == [0, 3, 6]
    assert_ledger_checked(run_dir)
