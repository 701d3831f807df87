"""Smoke test of scripts/bench_engine.py: its main() runs end to end on tiny sizes (no thresholds: figures are the
benchmark's job, not the test's)."""

from __future__ import annotations

import importlib.util
import os

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_engine", os.path.join(ROOT, "scripts", "bench_engine.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def test_long_tailed_lengths_are_bounded_and_skewed():
    bench = load_bench()
    lens = bench.long_tailed_lengths(2000, 4, 256, 1.2, seed=0)
    assert min(lens) >= 4 and max(lens) <= 256
    assert sorted(lens)[len(lens) // 2] < sum(lens) / len(lens)  # median below mean: a long tail
    assert max(lens) == 256


def test_main_runs_on_tiny_sizes(tmp_path):
    bench = load_bench()
    threads = torch.get_num_threads()
    try:
        res = bench.main(["--num-requests", "6", "--batch-size", "3", "--max-len", "8", "--hidden", "32",
                          "--updates", "2", "--qwen", "none", "--chat-groups", "2", "--chat-group-size", "2",
                          "--chat-rounds", "2", "--loras", "2", "--lora-rounds", "1", "--json",
                          str(tmp_path / "r.json")])
    finally:
        torch.set_num_threads(threads)
    assert res["continuous"]["tokens"] == res["hf_static"]["tokens"] == res["workload"]["tokens"]
    assert res["ratio_continuous_vs_hf_static"] > 0 and "ratio_continuous_vs_engine_static" in res
    u = res["update_tiny"]
    assert u["requests_lost_or_cut"] == 0 and u["pause_ms_max"] >= 0 and u["updates"] == 2
    pc = res["prefix_cache"]
    assert pc["prefix_hits"] > 0 and pc["cpu_ratio_off_vs_on"] > 0
    assert pc["on"]["prefill_tokens_per_turn"] < pc["off"]["prefill_tokens_per_turn"]
    lf = res["lean_forward"]
    assert lf["cpu_ratio_hf_vs_lean"] > 0
    assert len(lf["lean"]["cpu_ms_per_turn"]) == len(lf["hf"]["cpu_ms_per_turn"]) == 2
    ml = res["multi_lora"]
    assert ml["adapters"] == 2 and ml["ratio_many_vs_one_merged"] > 0 and ml["ratio_one_unmerged_vs_one_merged"] > 0
    assert (tmp_path / "r.json").is_file()
