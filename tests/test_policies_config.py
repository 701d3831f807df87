"""`policies:`: named frozen LoRA policies served beside the run's own; every bad list is refused at start-up,
named."""

from __future__ import annotations

import json

import pytest
import torch

from arl.config import ConfigError, ExperimentConfig, PolicyConfig, parse_overrides, policy_adapters
from arl.weights.adapter import LORA_A, LORA_B, write_peft_folder


@pytest.fixture
def adapter(tmp_path):
    payload = {"model.layers.0.self_attn.q_proj" + LORA_A: torch.zeros(4, 8),
               "model.layers.0.self_attn.q_proj" + LORA_B: torch.zeros(8, 4)}
    return write_peft_folder(payload, str(tmp_path / "opp"))


def parse(*overrides: str) -> ExperimentConfig:
    return parse_overrides(ExperimentConfig, list(overrides))


def test_a_frozen_policy_beside_a_lora_run_is_accepted(adapter):
    cfg = parse("learner.lora.rank=8", f"policies=[{{name: opponent, adapter: {adapter}}}]")
    assert cfg.policies == [PolicyConfig(name="opponent", adapter=adapter)]
    assert policy_adapters(cfg) == (4, ["q_proj"])
    assert parse().policies == []  # the default: one policy, as before


@pytest.mark.parametrize("policies, extra, why", [
    ("[{name: a, adapter: ADAPTER}, {name: a, adapter: ADAPTER}]", [], "two policies are named 'a'"),
    ("[{name: policy, adapter: ADAPTER}]", [], "the run's own policy's name"),
    ("[{name: 'a b', adapter: ADAPTER}]", [], "letters, digits"),
    ("[{name: a, adapter: ADAPTER, trainable: true}]", [], "starting it from a folder is not built"),
    ("[{name: a, adapter: ADAPTER, learner: {optimizer: {lr: 0.1}}}]", [], "a frozen policy .* has no learner"),
    ("[{name: a, adapter: base, trainable: true, learner: {optimizr: {lr: 0.1}}}]", [], "optimizr"),
    ("[{name: a, adapter: base, trainable: true, learner: {lora: {rank: 0}}}]", [], "trainable policy is a LoRA"),
    ("[{name: a, adapter: base, trainable: true}]", ["weights.transport=broadcast"], "weights.transport=disk"),
    ("[{name: a, adapter: base, trainable: true}]", ["recover=auto"], "recover=off"),
    ("[{name: a, adapter: base, trainable: true}]", ["learner.num_ranks=2"], "learner.num_ranks=1"),
    ("[{name: a, adapter: base, servers: [1]}]", [], r"servers \[1\]: each an inference server's index"),
    ("[{name: a, adapter: base, servers: [0, 0]}]", ["inference.num_workers=2"], "once"),
    ("[{name: a, adapter: /no/such/folder}]", [], "not a peft LoRA folder"),
    ("[{name: a, adapter: ADAPTER}]", ["learner.lora.rank=0"], "full fine-tuning would move under them"),
    ("[{name: a, adapter: ADAPTER}]", ["learner.lora.modules_to_save=[lm_head]"], "modules_to_save"),
    ("[{name: a, adapter: ADAPTER}]", ["inference.backend=sim"], "cannot serve named LoRA policies"),
])
def test_bad_policy_lists_are_refused_by_name(adapter, policies, extra, why):
    args = ["learner.lora.rank=8", *extra, "policies=" + policies.replace("ADAPTER", adapter)]
    with pytest.raises(ConfigError, match=why):
        parse(*args)


def test_an_adapter_that_is_not_lora_is_refused(adapter):
    with open(f"{adapter}/adapter_config.json") as f:
        config = json.load(f)
    with open(f"{adapter}/adapter_config.json", "w") as f:
        json.dump({**config, "peft_type": "PREFIX_TUNING"}, f)
    with pytest.raises(ConfigError, match="not a LoRA adapter"):
        parse("learner.lora.rank=8", f"policies=[{{name: a, adapter: {adapter}}}]")


def test_validation_applies_the_loaders_own_check(adapter):
    """What the inference servers could not load is refused before any starts: only safetensors weights, no
    rslora (the same `read_lora_config` the loader calls)."""
    import os

    with open(f"{adapter}/adapter_config.json") as f:
        config = json.load(f)
    with open(f"{adapter}/adapter_config.json", "w") as f:
        json.dump({**config, "use_rslora": True}, f)
    with pytest.raises(ConfigError, match="only plain LoRA adapters"):
        parse("learner.lora.rank=8", f"policies=[{{name: a, adapter: {adapter}}}]")
    with open(f"{adapter}/adapter_config.json", "w") as f:
        json.dump([config], f)  # valid JSON, not an object: refused by name, not an AttributeError
    with pytest.raises(ConfigError, match="adapter_config.json is not a JSON object"):
        parse("learner.lora.rank=8", f"policies=[{{name: a, adapter: {adapter}}}]")
    os.rename(f"{adapter}/adapter_model.safetensors", f"{adapter}/adapter_model.bin")
    with pytest.raises(ConfigError, match="not a peft LoRA folder"):
        parse("learner.lora.rank=8", f"policies=[{{name: a, adapter: {adapter}}}]")


def test_the_base_as_a_policy_is_a_zero_delta_on_the_runs_targets(tmp_path):
    """`adapter: base`: the base model itself (a LoRA run's policy as it started), as a rank-1 zero payload on the
    linear layers the run's own adapter targets, shaped from the model's config."""
    from arl.models.tiny import build_char_tokenizer, build_tiny_model, save_model_dir
    from arl.weights.adapter import base_payload

    tok = build_char_tokenizer()
    model_dir = save_model_dir(build_tiny_model(len(tok)), tok, str(tmp_path / "m"))
    cfg = parse("learner.lora.rank=8", "learner.lora.target_modules=[q_proj, down_proj]",
                "policies=[{name: start, adapter: base}]")
    assert policy_adapters(cfg) == (1, ["down_proj", "q_proj"])
    payload = base_payload(model_dir, ["q_proj", "down_proj"])
    model = build_tiny_model(len(tok))
    layers = len(model.model.layers)
    assert len(payload) == 4 * layers and all(float(v.abs().sum()) == 0.0 for v in payload.values())
    q = model.model.layers[0].self_attn.q_proj
    assert payload["model.layers.0.self_attn.q_proj" + LORA_A].shape == (1, q.in_features)
    assert payload["model.layers.0.self_attn.q_proj" + LORA_B].shape == (q.out_features, 1)
    with pytest.raises(ValueError, match="no linear layer"):
        base_payload(model_dir, ["nope"])


def test_a_trainable_policy_gets_a_learner_section_of_its_own():
    """`trainable: true`: its learner (learner1) trains by the run's learner section with the keys the policy sets;
    the inference servers make room for the rank its learner trains, not the base's rank-1 start."""
    from arl.config import policy_learner_config, trainable_policies

    cfg = parse("learner.lora.rank=8", "learner.optimizer.lr=2e-4",
                "policies=[{name: start, adapter: base}, {name: rival, adapter: base, trainable: true, "
                "learner: {optimizer: {lr: 1e-4}, lora: {rank: 16}}}]")
    (rival,) = trainable_policies(cfg)
    lc = policy_learner_config(cfg, rival)
    assert rival.name == "rival" and lc.optimizer.lr == 1e-4 and lc.lora.rank == 16
    assert lc.batch_size == cfg.learner.batch_size and cfg.learner.optimizer.lr == 2e-4  # the run's own unchanged
    assert policy_adapters(cfg)[0] == 16
    assert trainable_policies(parse("learner.lora.rank=8", "policies=[{name: start, adapter: base}]")) == []


def test_placement_names_the_placed_and_the_trained_policies():
    """A policy with `servers` is served there only; a trainable one by the run's configured servers (one added
    mid-run does not get its versions); the others by every server."""
    from arl.config import policy_placement

    cfg = parse("learner.lora.rank=8", "inference.num_workers=3",
                "policies=[{name: s, adapter: base}, {name: p, adapter: base, servers: [2]}, "
                "{name: t, adapter: base, trainable: true}]")
    assert policy_placement(cfg) == {"p": [2], "t": [0, 1, 2]}
