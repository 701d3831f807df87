"""The torch engine applies adapter payloads (`arl.weights.adapter`): merged into its own weight copies against the
kept base (each version from the base, not from the last merge), plain weights at decode, a full update un-merges."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from arl.weights.adapter import LORA_A, LORA_B
from tests.inference.test_torch_engine import greedy_reference, make_engine, make_model, ok, prompt, req

peft = pytest.importorskip("peft")
torch.set_num_threads(1)


def adapted(base: torch.nn.Module, seed: int, rank: int = 4, alpha: float = 8.0) -> tuple[torch.nn.Module, dict]:
    """A peft copy of `base` with random (non-zero) adapters on q/v, merged into a plain model, and its payload."""
    from arl.learner.lora import adapter_payload

    pm = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=rank, lora_alpha=alpha,
                                                                   target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    payload = {k: v.clone() for k, v in adapter_payload(pm).items()}
    return pm.merge_and_unload().eval(), payload


@pytest.mark.asyncio
async def test_adapter_versions_merge_into_the_base_and_a_full_update_unmerges(tmp_path: Path):
    base = make_model(0)
    want1, pay1 = adapted(base, 1)
    want2, pay2 = adapted(base, 2)
    assert set(pay1) == {f"model.layers.{i}.self_attn.{m}_proj{s}" for i in (0, 1) for m in "qv"
                         for s in (LORA_A, LORA_B)}
    engine = make_engine(copy.deepcopy(base))
    p = prompt(3, 7)
    q0 = engine.model.model.layers[0].self_attn.q_proj
    await engine.update_weights_from_tensors(dict(pay1), version=1)
    s = ok(await engine.agenerate(req("a", p, greedy=True, max_new_tokens=8))).samples[0]
    assert s.output_ids.tolist() == greedy_reference(want1, p, 8) and s.output_versions.tolist() == [1] * 8
    for name, w in want1.state_dict().items():
        torch.testing.assert_close(engine.model.state_dict()[name], w, rtol=1e-5, atol=1e-5)
    # v2 is merged into the base, not on top of v1; by file (the disk transport) as well as by tensors
    save_file(pay2, str(tmp_path / "v2.safetensors"))
    await engine.update_weights(str(tmp_path / "v2.safetensors"), version=2)
    for name, w in want2.state_dict().items():
        torch.testing.assert_close(engine.model.state_dict()[name], w, rtol=1e-5, atol=1e-5)
    # decode runs plain weights: no adapter module was added to the engine's model
    assert type(engine.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert engine.model.model.layers[0].self_attn.q_proj is q0
    # a payload that does not fit is refused whole; the version and weights stay
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    bad = dict(pay1)
    bad["model.layers.0.self_attn.q_proj" + LORA_A] = torch.zeros(4, 7)
    with pytest.raises(ValueError, match="does not fit the model"):
        await engine.update_weights_from_tensors(bad, version=3)
    with pytest.raises(ValueError, match="no 2-d weight model.layers.0.self_attn.nope.weight"):
        await engine.update_weights_from_tensors({**pay1, "model.layers.0.self_attn.nope" + LORA_A: torch.zeros(4, 64),
                                                  "model.layers.0.self_attn.nope" + LORA_B: torch.zeros(64, 4)}, 3)
    assert engine.version == 2
    assert all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
    # a full state dict replaces everything (the base too): the next adapter merges into it
    other = make_model(5)
    await engine.update_weights_from_tensors({k: v.clone() for k, v in other.state_dict().items()}, version=4)
    want3, pay3 = adapted(other, 3)
    await engine.update_weights_from_tensors(pay3, version=5)
    s = ok(await engine.agenerate(req("b", p, greedy=True, max_new_tokens=8))).samples[0]
    await engine.close()
    assert s.output_ids.tolist() == greedy_reference(want3, p, 8)


@pytest.mark.asyncio
async def test_a_refused_full_payload_keeps_the_lora_base():
    """A full state dict that does not fit is refused whole, the kept base with it: the next adapter still merges
    into the base, not onto the weights the previous adapter merged into."""
    base = make_model(0)
    _, pay1 = adapted(base, 1)
    want2, pay2 = adapted(base, 2)
    engine = make_engine(copy.deepcopy(base))
    try:
        await engine.update_weights_from_tensors(dict(pay1), version=1)
        partial = {k: v.clone() for k, v in base.state_dict().items() if "layers.1." not in k}
        with pytest.raises(ValueError, match="do not match the model"):
            await engine.update_weights_from_tensors(partial, version=2)
        await engine.update_weights_from_tensors(dict(pay2), version=3)
        for name, w in want2.state_dict().items():
            torch.testing.assert_close(engine.model.state_dict()[name], w, rtol=1e-5, atol=1e-5)
    finally:
        await engine.close()


@pytest.mark.asyncio
async def test_a_saved_tied_head_gets_its_own_tensor_and_a_full_update_of_the_tied_model_still_loads():
    base = make_model(0, tie=True)
    _, pay = adapted(base, 1)
    head = torch.randn(base.lm_head.weight.shape, generator=torch.Generator().manual_seed(2))
    engine = make_engine(copy.deepcopy(base))
    embed0 = engine.model.model.embed_tokens.weight.detach().clone()
    try:
        await engine.update_weights_from_tensors({**pay, "lm_head.weight": head.clone()}, version=1)
        assert torch.equal(engine.model.lm_head.weight, head)
        assert torch.equal(engine.model.model.embed_tokens.weight, embed0)  # the base, as peft's copy leaves it
        await engine.update_weights_from_tensors({**pay, "lm_head.weight": head * 2}, version=2)
        assert torch.equal(engine.model.lm_head.weight, head * 2)
        assert torch.equal(engine.model.model.embed_tokens.weight, embed0)
        # a full state dict of the tied model names the embedding only (the head is its alias): both get it
        other = make_model(5, tie=True)
        full = {k: v.clone() for k, v in other.state_dict().items() if k != "lm_head.weight"}
        await engine.update_weights_from_tensors(full, version=3)
        for name, w in other.state_dict().items():
            torch.testing.assert_close(engine.model.state_dict()[name], w, rtol=0, atol=0)
    finally:
        await engine.close()
