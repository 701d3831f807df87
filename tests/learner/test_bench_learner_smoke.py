"""scripts/bench_learner.py runs end to end at tiny sizes (no timing thresholds: the machine is shared)."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

pytest.importorskip("deepspeed")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bench_learner_tiny(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("bench_learner", os.path.join(ROOT, "scripts", "bench_learner.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "r.json"
    res = mod.main(["--tiny", "--arrival-order", "--json", str(out)])
    text = capsys.readouterr().out
    assert "packed vs length-grouped padding:" in text and "x CPU time" in text
    assert "DeepSpeed (ZeRO 0, gloo) vs plain torch" in text
    assert json.loads(out.read_text())["tokens"] == res["tokens"] > 0
    for key in ("packed_over_padded", "packed_over_padded_arrival", "deepspeed_over_plain"):
        assert all(math.isfinite(v) and v > 0 for v in res[key].values()), key
    assert res["pad_frac"]["packed"] == 0.0 and res["pad_frac"]["padded"] > 0.0
    work, att = res["breakdown"]["work"], res["breakdown"]["attention_cpu_s"]
    assert work["packed"]["tokens"] == res["tokens"] < work["padded"]["tokens"]
    assert 0 < work["packed"]["attention_cells"] < work["padded"]["attention_cells"]
    assert att["packed"] > 0 and att["padded"] > 0  # both layouts' attention calls were replayed
    assert "learner step: " in text and "% of its FLOP time at the measured matmul rate" in text
    d = res["default_step"]
    assert d["flops"] > 0 and d["matmul_flops_per_s"] > 0 and d["cpu"] > 0 and d["loss_tokens"] > 0
    assert d["clip_frac"] > 0  # the groups' advantages are not all zero and the minibatches' clip binds
    assert "x less CPU per step than plain packed rows" in text and d["cpu_plain"] > 0
    assert d["positions"] < d["tokens"] and 0 < d["flops"] < d["flops_plain"]  # the prompts ran once per group


def test_forward_flops_by_hand():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.spec_from_file_location("bench_learner", os.path.join(ROOT, "scripts", "bench_learner.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True))
    linear = 4 * 8 * 8 + 3 * 8 * 16 + 8 * 10  # q k v o, gate up down, the (tied) LM head
    # two sequences of 3 and 1 tokens: 4 tokens, 6 + 1 causal pairs
    assert mod.forward_flops(model, [3, 1]) == 2 * linear * 4 + 2 * 2 * 7 * 8 * 1
    # a tree row: a sequence of 3 owning all its nodes, one of 4 owning its last 2 (2 ancestors): 5 nodes;
    # pairs 6 + (2 * 2 + 3)
    assert mod.tree_forward_flops(model, [3, 2], [3, 4]) == 2 * linear * 5 + 2 * 2 * 13 * 8 * 1
