"""The engine's lean forward gives the model's own logits: for every family it claims, on a left-padded prefill, a
prefill on a cached past, and decode steps; the engine's outputs are the same with it on and off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import (DynamicCache, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

from arl.config import ExperimentConfig, parse_overrides
from arl.inference.lean_forward import SUPPORTED, lean_forward_for
from tests.inference.test_prefix_cache import same_chats_on_both
from tests.inference.test_torch_engine import make_engine, make_model

VOCAB = 50
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def family(name: str) -> torch.nn.Module:
    torch.manual_seed(3)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**SHAPE, rope_scaling={"rope_type": "linear", "factor": 2.0})).eval()
    if name == "mistral":
        return MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None)).eval()
    if name == "qwen2":  # q/k/v biases
        return Qwen2ForCausalLM(Qwen2Config(**SHAPE)).eval()
    return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=32)).eval()  # per-head q/k norms, head_dim != hidden/heads


def hf_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor,
              cache: DynamicCache) -> torch.Tensor:
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
    return out.logits[:, -1].float()


def left_padded(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, VOCAB, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, width - n:] = 1
    ids = ids.masked_fill(mask == 0, 0)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, pos


@pytest.mark.parametrize("name", sorted(SUPPORTED))
@torch.no_grad()
def test_logits_match_the_models_forward(name: str):
    model = family(name)
    lean = lean_forward_for(model)
    assert lean is not None
    results = []
    for run in (lambda *a: hf_logits(model, *a), lean):
        ids, mask, pos = left_padded([9, 4, 12], seed=0)
        cache = DynamicCache()
        steps = [run(ids, mask, pos, cache)]
        # padding KV made finite as the engine does, then a 3-token suffix prefill on that past
        for layer in cache.layers:
            layer.keys.masked_fill_(mask[:, None, :, None] == 0, 0)
            layer.values.masked_fill_(mask[:, None, :, None] == 0, 0)
        more = torch.randint(1, VOCAB, (3, 3), generator=torch.Generator().manual_seed(1))
        mask = torch.cat([mask, torch.ones(3, 3, dtype=torch.long)], 1)
        pos = pos[:, -1:] + 1 + torch.arange(3)[None]
        steps.append(run(more, mask, pos, cache))
        for t in range(3):  # decode steps
            nxt = steps[-1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            pos = pos[:, -1:] + 1
            steps.append(run(nxt, mask, pos, cache))
        results.append(steps)
    for hf_step, lean_step in zip(*results, strict=True):
        assert torch.isfinite(lean_step).all()
        torch.testing.assert_close(lean_step, hf_step, atol=1e-5, rtol=1e-5)


def test_other_architectures_keep_their_own_forward():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert lean_forward_for(gpt2) is None
    engine = make_engine(make_model(0), lean_forward=False)
    assert engine._lean is None


@pytest.mark.asyncio
async def test_engine_outputs_are_the_same_with_the_lean_forward_on_and_off():
    off = make_engine(make_model(0), prefix_cache_tokens=4096, lean_forward=False)
    on = make_engine(make_model(0), prefix_cache_tokens=4096)
    assert on._lean is not None
    await same_chats_on_both(off, on)


@pytest.mark.asyncio
async def test_config_key_reaches_the_engine(tmp_path: Path):
    from arl.inference.factory import build_engine
    from arl.models.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    assert ExperimentConfig().inference.torch.lean_forward
    tok = build_char_tokenizer()
    folder = save_model_dir(build_tiny_model(len(tok)), tok, str(tmp_path / "model"))
    for value, lean in (("true", True), ("false", False)):
        inference = parse_overrides(ExperimentConfig, [f"inference.torch.lean_forward={value}"]).inference
        engine = build_engine(folder, inference, seed=0)
        try:
            assert (engine._lean is not None) is lean
        finally:
            await engine.close()
