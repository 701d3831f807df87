"""Sequence packing: bin packing, the packed layout, and packed == padded for logprobs, loss and gradient."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from arl.api.engine import TrainBatch
from arl.api.types import Trajectory
from arl.learner.batching import (
    build_micro_batches,
    build_packed_micro_batches,
    collate_packed,
    pack_by_token_budget,
)
from arl.learner.packing import VARLEN_ATTENTION, enable_varlen_attention, packed_forward_kwargs
from arl.learner.ppo import token_logprobs

torch.set_num_threads(1)


def _traj(prompt, gen, v=0, lp=-1.0, reward=0.0, gid="g"):
    ids = list(prompt) + list(gen)
    mask = [0] * len(prompt) + [1] * len(gen)
    return Trajectory(ids, mask, [lp if m else 0.0 for m in mask], [v if m else -1 for m in mask], reward, gid)


def test_pack_by_token_budget_first_fit_decreasing():
    # lengths by size: 8 (i2), 5 (i0), 3 (i3), 3 (i4), 2 (i1); budget 9:
    # 8 -> bin A (room 1); 5 -> bin B (room 4); 3 -> B (room 1); 3 -> bin C (room 6); 2 -> C
    assert pack_by_token_budget([5, 2, 8, 3, 3], 9) == [[2], [0, 3], [1, 4]]
    assert pack_by_token_budget([20, 1], 4) == [[0], [1]]  # oversize sequence alone, never dropped
    assert pack_by_token_budget([2, 2, 2], 6) == [[0, 1, 2]]  # exactly full
    rng = np.random.default_rng(0)
    lens = rng.integers(1, 50, size=200).tolist()
    bins = pack_by_token_budget(lens, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lens[i] for i in b) <= 64 for b in bins)
    assert len(bins) <= math.ceil(sum(lens) / 64) * 1.25  # FFD is near the bound
    with pytest.raises(ValueError):
        pack_by_token_budget([1], 0)


def test_collate_packed_layout():
    trajs = [_traj([1, 2], [5, 6, 7], v=3, lp=-0.5), _traj([9], [4], v=1, lp=-2.0), _traj([], [8, 8], v=0)]
    mb = collate_packed(trajs, [0, 1, 2], [1.5, -2.0, 4.0], token_weights=[1.0, 2.0, np.array([7, 3], np.float32)])
    assert mb.packed and mb.attention_mask is None and mb.seq_lens.numel() == 3
    assert mb.input_ids.tolist() == [[1, 2, 5, 6, 7, 9, 4, 8, 8]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 0, 1]]
    assert mb.cu_seqlens.tolist() == [0, 5, 7, 9]
    # the first token of each sequence is never in the loss (the empty-prompt trajectory loses its first token)
    assert mb.loss_mask.int().tolist() == [[0, 0, 1, 1, 1, 0, 1, 0, 1]]
    assert mb.logprobs.tolist() == [[0, 0, -0.5, -0.5, -0.5, 0, -2.0, 0, -1.0]]
    assert mb.versions.tolist() == [[-1, -1, 3, 3, 3, -1, 1, -1, 0]]
    assert mb.advantages.tolist() == [[0, 0, 1.5, 1.5, 1.5, 0, -2.0, 0, 4.0]]
    assert mb.token_weights.tolist() == [[0, 0, 1, 1, 1, 0, 2, 0, 3]]
    assert mb.n_loss_tokens == 5 and mb.padded_tokens == mb.real_tokens == 9
    empty = mb.empty_like()
    assert empty.packed and empty.n_loss_tokens == 0 and empty.input_ids.shape == (1, 5)
    assert empty.cu_seqlens.tolist() == [0, 5]
    mbs = build_packed_micro_batches(trajs, 7, [0.0, 0.0, 0.0])
    assert [mb.indices for mb in mbs] == [[0, 1], [2]]  # 5 + 2 fill the first bin (ties: lower index first)
    assert sum(mb.n_loss_tokens for mb in mbs) == 5


def _random_trajs(seed, n=9, vocab=32):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = rng.integers(1, vocab, size=int(rng.integers(1, 6)))
        g = rng.integers(1, vocab, size=int(rng.integers(1, 12)))
        out.append(_traj(p, g, lp=-3.0, reward=float(rng.integers(0, 2)), gid=f"g{i // 3}"))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("mode", ["varlen", "mask"])
def test_packed_logprobs_equal_padded(family, mode):
    kw = dict(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
    torch.manual_seed(0)
    model = (LlamaForCausalLM(LlamaConfig(**kw)) if family == "llama" else Qwen2ForCausalLM(Qwen2Config(**kw)))
    model.eval()
    trajs = _random_trajs(1)
    (pad,) = build_micro_batches(trajs, 10_000)
    (pk,) = build_packed_micro_batches(trajs, 10_000)
    assert pad.indices == pk.indices
    with torch.no_grad():
        ref = token_logprobs(model(input_ids=pad.input_ids, attention_mask=pad.attention_mask,
                                   use_cache=False).logits, pad.input_ids)
        if mode == "varlen":
            assert enable_varlen_attention(model) == VARLEN_ATTENTION
            out = model(**packed_forward_kwargs(pk), use_cache=False).logits
            # the padded path still works under the varlen implementation (mask function defers to sdpa)
            ref2 = token_logprobs(model(input_ids=pad.input_ids, attention_mask=pad.attention_mask,
                                        use_cache=False).logits, pad.input_ids)
            torch.testing.assert_close(ref2, ref)
        else:
            out = model(input_ids=pk.input_ids, position_ids=pk.position_ids, use_cache=False).logits
        got = token_logprobs(out, pk.input_ids)
    torch.testing.assert_close(got[pk.loss_mask], ref[pad.loss_mask], rtol=1e-5, atol=1e-5)
    # sanity: without restarting positions / boundaries the packed row would be wrong
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        wrong = token_logprobs(model(input_ids=pk.input_ids, use_cache=False).logits, pk.input_ids)
    assert (wrong[pk.loss_mask] - ref[pad.loss_mask]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------ learner level
deepspeed = pytest.importorskip("deepspeed")

from tests.learner._build import make_actor  # noqa: E402


def _tiny(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, pad_token_id=0))


def _capture_grads(lrn):
    grads = {}
    orig = lrn.engine.model_engine.step

    def step(*a, **kw):
        for n, p in lrn.engine.module.named_parameters():
            grads[n] = p.grad.detach().clone()
        return orig(*a, **kw)

    lrn.engine.model_engine.step = step
    return grads


@pytest.mark.parametrize("extra", [dict(), dict(loss_agg="seq"), dict(packed_attention="mask")])
def test_packing_gives_the_same_loss_and_gradient_as_padding(extra):
    base = _tiny(3)
    batch = _random_trajs(4, n=12)
    padded = make_actor(copy.deepcopy(base), lr=1e-3, grad_clip=0.0, packing=False, max_tokens_per_mb=4096,
                              **extra)
    packed = make_actor(copy.deepcopy(base), lr=1e-3, grad_clip=0.0, packing=True, max_tokens_per_mb=4096,
                              **extra)
    packed_small = make_actor(copy.deepcopy(base), lr=1e-3, grad_clip=0.0, packing=True,
                                    max_tokens_per_mb=20, **extra)
    assert len(build_packed_micro_batches(batch, 20)) >= 4
    g_pad, g_pk, g_small = _capture_grads(padded), _capture_grads(packed), _capture_grads(packed_small)
    m_pad, m_pk, m_small = padded.step(batch), packed.step(batch), packed_small.step(batch)
    assert m_pad["pad_frac"] > 0.2 and m_pk["pad_frac"] == 0.0 and m_small["pad_frac"] == 0.0
    for m in (m_pk, m_small):
        assert m["loss"] == pytest.approx(m_pad["loss"], rel=1e-5, abs=1e-7)
        for k in ("n_tokens", "clip_frac", "entropy", "imp_weight_mean", "adv_abs_mean", "grad_norm"):
            assert m[k] == pytest.approx(m_pad[k], rel=1e-5, abs=1e-7), k
    for n in g_pad:
        torch.testing.assert_close(g_pk[n], g_pad[n], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(g_small[n], g_pad[n], rtol=1e-4, atol=1e-6)
    # and a second step (on updated weights, with non-trivial ratios) still agrees
    m_pad2, m_pk2 = padded.step(batch), packed.step(batch)
    assert m_pk2["loss"] == pytest.approx(m_pad2["loss"], rel=1e-4, abs=1e-6)


def test_padded_micro_batches_attend_causally_without_a_mask(monkeypatch):
    # right padding under a causal mask: no real token sees a padding key, so the padded path passes no mask and
    # SDPA keeps its causal skip (a [B, 1, L, L] padding mask made it attend to every cell), same logprobs
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, *a, **kw):
        calls.append((q.shape[0], attn_mask is None, kw.get("is_causal")))
        return sdpa(q, k, v, attn_mask, *a, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    base = _tiny(5)
    batch = _random_trajs(6, n=9)
    padded = make_actor(copy.deepcopy(base), lr=1e-3, packing=False, max_tokens_per_mb=4096)
    (mb,) = build_micro_batches(batch, 4096)
    assert mb.input_ids.shape[0] == 9 and mb.padded_tokens > mb.real_tokens  # one padded micro-batch
    with torch.no_grad():
        ref = token_logprobs(base(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits,
                             mb.input_ids)
    calls.clear()
    got = padded.engine.forward_logprobs(TrainBatch(batch))
    assert calls and all(c == (9, True, True) for c in calls), calls
    for row, lp, n in zip(ref, got, mb.seq_lens.tolist()):
        torch.testing.assert_close(torch.from_numpy(lp), row[:n], rtol=1e-5, atol=1e-5)
    calls.clear()
    padded.step(batch)
    assert calls and all(mask_free and causal for _, mask_free, causal in calls)


@pytest.mark.parametrize("kw", [dict(bf16=True, zero_stage=1), dict(zero_stage=3)])
def test_packing_with_bf16_and_zero3(kw):
    base = _tiny(9)
    batch = _random_trajs(5, n=9)
    packed = make_actor(copy.deepcopy(base), lr=1e-3, packing=True, max_tokens_per_mb=24, **kw)
    padded = make_actor(copy.deepcopy(base), lr=1e-3, packing=False, max_tokens_per_mb=24, **kw)
    m_pk, m_pad = packed.step(batch), padded.step(batch)
    tol = 2e-2 if kw.get("bf16") else 1e-5
    assert m_pk["loss"] == pytest.approx(m_pad["loss"], rel=tol, abs=tol)
    assert m_pk["grad_norm"] == pytest.approx(m_pad["grad_norm"], rel=tol * 5)

