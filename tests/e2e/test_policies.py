"""`policies:` end to end: a LoRA run serving a frozen named policy beside its own, every role a process. The
frozen policy is loaded by every inference server before it registers and stays at version 0 while the run's
adapter, served from a slot of its own, moves version by version."""

from __future__ import annotations

import os

import pytest

from tests.e2e.test_end_to_end import SMALL, assert_clean_run, model_cache, read_metrics, run_main  # noqa: F401

pytest.importorskip("peft")


def frozen_adapter(model_dir: str, out_dir: str, rank: int = 4) -> str:
    """A random rank-`rank` adapter on every q_proj of the model in `model_dir`, as a peft folder."""
    import torch
    from transformers import AutoConfig

    from arl.weights.adapter import LORA_A, LORA_B, write_peft_folder

    cfg = AutoConfig.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(0)
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    q_out = heads * getattr(cfg, "head_dim", hidden // heads)
    payload = {}
    for i in range(cfg.num_hidden_layers):
        name = f"model.layers.{i}.self_attn.q_proj"
        payload[name + LORA_A] = torch.randn((rank, hidden), generator=g) * 0.1
        payload[name + LORA_B] = torch.randn((q_out, rank), generator=g) * 0.1
    return write_peft_folder(payload, out_dir, base_model=model_dir)


def warm_model(cache: str) -> str:
    """The default experiment's warm tiny model (the folder the run itself will use)."""
    from arl.cli import load_config
    from arl.launch.run import prepare_model
    from experiments import MODULES

    return prepare_model(load_config([f"model.cache_dir={cache}"], MODULES))


@pytest.mark.timeout(300)
def test_a_lora_run_serves_a_frozen_policy_beside_its_own(tmp_path, model_cache):
    steps = 3
    adapter = frozen_adapter(warm_model(model_cache), str(tmp_path / "opponent"))
    proc, run_dir = run_main(SMALL + ["learner.lora.rank=8", f"total_train_steps={steps}",
                                      f"policies=[{{name: opponent, adapter: {adapter}}}]"],
                             str(tmp_path), model_cache)
    assert_clean_run(proc, run_dir, steps)
    log = open(os.path.join(run_dir, "logs", "inference0.log")).read()
    assert log.count("loaded policy opponent (slot") == 1
    own = [line for line in log.splitlines() if "loaded the engine's own adapter (slot 2)" in line]
    assert [int(line.rsplit("version ", 1)[1]) for line in own] == list(range(1, steps + 1))
    last = [m for m in read_metrics(run_dir) if m["type"] == "eval"][-1]
    assert last["roles"]["inference0"]["policies"] == {"opponent": 0}  # frozen: never updated


@pytest.mark.timeout(300)
def test_a_frozen_policy_that_does_not_fit_the_model_stops_the_run_at_start_naming_it(tmp_path, model_cache):
    import torch

    from arl.weights.adapter import LORA_A, LORA_B, write_peft_folder

    bad = write_peft_folder({"model.layers.0.self_attn.q_proj" + LORA_A: torch.zeros(4, 999),
                             "model.layers.0.self_attn.q_proj" + LORA_B: torch.zeros(8, 4)}, str(tmp_path / "bad"))
    proc, _ = run_main(SMALL + ["learner.lora.rank=8", "total_train_steps=2",
                                f"policies=[{{name: opp, adapter: {bad}}}]"], str(tmp_path), model_cache)
    assert proc.returncode == 1
    assert "run failed: role inference0" in proc.stderr and "policy 'opp': adapter does not fit" in proc.stderr
