"""The several-policies examples end to end, every role a process: `experiment=self-play` (the tiny model plays
Nim against itself, both seats the run's LoRA policy, evaluated against the frozen start served as `policies:
[{name: start, adapter: base}]`) and `experiment=proposer-solver` (one policy writes problems and solves them).
Whether they learn is measured by `scripts/multi_policy_seeds.py` (docs/benchmarks.md), not here: a short run's
rise varies."""

from __future__ import annotations

import json
import os

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
    # the start against itself: each pile won once in its two seat orders (0.5 exactly unless two moves tie to the
    # last bit somewhere and the two games break the tie differently)
    assert 0.4 <= evals[0]["first_acc"] <= 0.6
    for ev in evals:
        assert ev["n"] == 32 and not ev["errors"]
        means = ev["traj_means"]
        assert 0 <= means["winning_moves"] <= means["winning_chances"]
        assert ev["roles"]["inference0"]["policies"] == {"start": 0}  # the frozen start is never updated
    assert [m["version"] for m in evals] == [0, 3, 6]
    assert_ledger_checked(run_dir)


@pytest.mark.timeout(300)
def test_proposer_solver_trains_on_the_problems_it_writes(tmp_path, model_cache):
    from arl.data.arith import make_arith_splits

    steps = 4
    proc, run_dir = run_main(["experiment=proposer-solver", f"total_train_steps={steps}", "eval.every_n_steps=0",
                              "eval.max_prompts=20", "progress=false", "learner.batch_size=2",
                              "rollout.trace_rate=1.0"], str(tmp_path), model_cache)
    assert_clean_run(proc, run_dir, steps)
    stats = assert_ledger_checked(run_dir)["traj_stats"]
    assert stats["valid"] > 0 and stats["solve_rate"] > 0  # valid proposals were solved, some of the time
    held_out = {r["id"] for r in make_arith_splits(49, 200, seed=0)[1]}
    traced = [json.loads(line) for line in open(os.path.join(run_dir, "traces.jsonl"))]
    solved = [t["metadata"]["prompt_id"] for t in traced if t.get("metadata", {}).get("role") == "solver"]
    assert solved and not held_out & set(solved)  # the solver trained only on problems outside the held-out split


@pytest.mark.timeout(300)
def test_two_policies_train_separately_in_one_run(tmp_path, model_cache):
    """`experiment=self-play-rivals`: the run's policy and `rival` (trainable, learner1) play each other; each
    learner trains its own seat's moves with its own versions, the rival placed on server 1 only (its versions go
    there, its requests too), and both write their final adapters."""
    steps = 6
    policies = "[{name: start, adapter: base}, {name: rival, adapter: base, trainable: true, servers: [1]}]"
    proc, run_dir = run_main(["experiment=self-play-rivals", f"total_train_steps={steps}", "eval.every_n_steps=3",
                              "progress=false", "learner.batch_size=4", "inference.num_workers=2",
                              f"policies={policies}"], str(tmp_path), model_cache)
    assert_clean_run(proc, run_dir, steps)
    records = read_metrics(run_dir)
    rival = [m for m in records if m["type"] == "policy_step"]
    assert [m["version"] for m in rival] == list(range(1, steps + 1)) and {m["policy"] for m in rival} == {"rival"}
    evals = [m for m in records if m["type"] == "eval"]
    roles = evals[-1]["roles"]
    served = roles["inference1"]["policies"]
    assert served["start"] == 0 and served["rival"] >= steps - 3  # the frozen start stays, the rival moves on
    assert "rival" not in roles["inference0"]["policies"]  # placed on server 1 only
    assert roles["inference0"]["policy_updates"] == 0 and roles["inference1"]["policy_updates"] >= steps - 3
    assert os.path.exists(os.path.join(run_dir, "final-rival", "adapter_model.safetensors"))
    assert os.path.exists(os.path.join(run_dir, "final", "adapter_model.safetensors"))
    assert_ledger_checked(run_dir)
    summary = [m for m in records if m["type"] == "summary"][-1]
    books = summary["policies"]["rival"]  # the rival's own books
    assert books["version"] == steps and books["trained_groups"] >= steps * 4 and books["invalid_groups"] == 0
    assert books["trained_twice"] == 0 and books["unaccounted"] == 0
