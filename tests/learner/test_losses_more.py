"""Dual clip, token weights (sequence-level aggregation, staleness), KL to a reference, turn-level discount, LR
schedule: pure functions against values computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from arl.learner.ppo import (
    decoupled_ppo_loss,
    discounted_turn_returns,
    kl_penalty,
    sequence_level_weights,
    stale_token_weights,
    turn_level_advantages,
    turn_segments,
)

torch.set_num_threads(1)
L = math.log


def t(*x):
    return torch.tensor(x, dtype=torch.float32)


def ones(n):
    return torch.ones(n, dtype=torch.bool)


def test_dual_clip_bounds_negative_advantages_only():
    # r = 5 with A = -1: PPO term max(5, 1.2) = 5, dual clip min(5, 3) = 3 (active);
    # r = 2 with A = -1: max(2, 1.2) = 2 < 3 (inactive); r = 5 with A = +1: max(-5, -1.2) = -1.2 (never for A > 0)
    logp = torch.tensor([L(5.0), L(2.0), L(5.0)], requires_grad=True)
    z = torch.zeros(3)
    loss, st = decoupled_ppo_loss(logp, z, z, t(-1.0, -1.0, 1.0), ones(3), dual_clip_c=3.0)
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3, rel=1e-6)
    assert st["dual_clip_frac"].item() == pytest.approx(1 / 3)
    assert st["clip_frac"].item() == pytest.approx(1 / 3)  # token 2's clipped term
    loss.backward()
    # token 0: constant 3 -> no gradient; token 1: d(-A r / 3)/dlogp = r/3 = 2/3; token 2: clipped -> 0
    torch.testing.assert_close(logp.grad, t(0.0, 2.0 / 3, 0.0))
    off, st_off = decoupled_ppo_loss(logp.detach(), z, z, t(-1.0, -1.0, 1.0), ones(3))
    assert off.item() == pytest.approx((5.0 + 2.0 - 1.2) / 3, rel=1e-6) and st_off["dual_clip_frac"] == 0
    with pytest.raises(ValueError):
        decoupled_ppo_loss(logp.detach(), z, z, t(-1.0, -1.0, 1.0), ones(3), dual_clip_c=1.0)


def test_dual_clip_with_behaviour_weight_and_mask():
    # w = 2 multiplies the dual-clipped value: 2 * min(max(4, 1.2), 3) = 6; masked token ignored
    prox = t(0.0, 0.0)
    behav = t(-L(2.0), 0.0)
    logp = t(L(4.0), 50.0)
    loss, _ = decoupled_ppo_loss(logp, prox, behav, t(-1.0, -1.0), torch.tensor([True, False]), dual_clip_c=3.0)
    assert loss.item() == pytest.approx(6.0, rel=1e-6)


def test_token_weights_and_denominator():
    lp = t(-1.0, -1.0, -1.0, 7.0)
    # on-policy: token loss = -A; weighted sum = -(0.5*2 + 2*1 + 1*(-3)) = 0 -> use other values
    adv = t(2.0, 1.0, 4.0, 9.0)
    w = t(0.5, 2.0, 0.25, 100.0)
    mask = torch.tensor([1, 1, 1, 0], dtype=torch.bool)
    loss, st = decoupled_ppo_loss(lp, lp, lp, adv, mask, token_weights=w, denominator=2.0)
    assert loss.item() == pytest.approx(-(1.0 + 2.0 + 1.0) / 2.0)
    assert st["n_tokens"].item() == 3  # stats are per token, unweighted
    with pytest.raises(ValueError):
        decoupled_ppo_loss(lp, lp, lp, adv, mask, token_weights=w[:3])


def test_sequence_level_aggregation_by_hand():
    # two sequences packed in one row: seq A has 1 loss token (adv 3), seq B has 3 (adv -1 each)
    m = np.array([0, 1, 0, 1, 1, 1], bool)
    wa = sequence_level_weights(m[:2])
    wb = sequence_level_weights(m[2:])
    np.testing.assert_allclose(wa, [0.0, 1.0])
    np.testing.assert_allclose(wb, [0.0, 1 / 3, 1 / 3, 1 / 3])
    lp = torch.zeros(6)
    adv = t(0.0, 3.0, 0.0, -1.0, -1.0, -1.0)
    seq, _ = decoupled_ppo_loss(lp, lp, lp, adv, torch.from_numpy(m), token_weights=torch.from_numpy(
        np.concatenate([wa, wb])), denominator=2.0)
    tok, _ = decoupled_ppo_loss(lp, lp, lp, adv, torch.from_numpy(m))
    assert seq.item() == pytest.approx(-(3.0 + -1.0) / 2)  # mean of the sequences' mean advantages
    assert tok.item() == pytest.approx(-(3.0 - 3.0) / 4)
    np.testing.assert_allclose(sequence_level_weights([0, 0]), [0.0, 0.0])


def test_kl_estimators():
    logp, ref = t(-1.0, -2.0), t(-1.5, -1.0)
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), t(0.5, -1.0))
    # d = ref - logp = (-0.5, 1): exp(d) - d - 1
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), t(math.exp(-0.5) - 0.5, math.e - 2.0))
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k2")


def test_kl_term_in_loss_value_gradient_and_garbage():
    logp = torch.tensor([-1.0, -2.0, 30.0], requires_grad=True)
    ref = t(-1.5, -1.0, -90.0)  # masked garbage must stay finite in value and gradient
    mask = torch.tensor([1, 1, 0], dtype=torch.bool)
    adv = torch.zeros(3)
    loss, st = decoupled_ppo_loss(logp, logp.detach(), logp.detach(), adv, mask, ref_logp=ref, kl_coef=0.1,
                                  kl_estimator="k3")
    k3 = (math.exp(-0.5) - 0.5, math.e - 2.0)
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, rel=1e-6)
    assert st["kl_ref"].item() == pytest.approx(sum(k3) / 2, rel=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp); times 0.1 / 2
    torch.testing.assert_close(logp.grad, t(0.05 * (1 - math.exp(-0.5)), 0.05 * (1 - math.e), 0.0))
    loss_k1, st1 = decoupled_ppo_loss(logp.detach(), logp.detach(), logp.detach(), adv, mask, ref_logp=ref,
                                      kl_coef=0.1, kl_estimator="k1")
    assert loss_k1.item() == pytest.approx(0.1 * (0.5 - 1.0) / 2, rel=1e-6)
    off, st_off = decoupled_ppo_loss(logp.detach(), logp.detach(), logp.detach(), adv, mask, ref_logp=ref)
    assert off.item() == 0.0 and st_off["kl_ref"] == 0


def test_turn_segments_and_discounted_returns():
    assert turn_segments([0, 0, 1, 1, 0, 1, 0, 1]) == [(2, 4), (5, 6), (7, 8)]
    assert turn_segments([0, 0]) == [] and turn_segments([1]) == [(0, 1)]
    np.testing.assert_allclose(discounted_turn_returns([0.0, 0.0, 1.0], 0.9), [0.81, 0.9, 1.0])
    np.testing.assert_allclose(discounted_turn_returns([1.0, 2.0], 0.5), [2.0, 2.0])
    with pytest.raises(ValueError):
        discounted_turn_returns([1.0], 1.5)


def test_turn_level_advantages_by_hand():
    # group g: returns [1, 2] and [0] -> baseline = mean first-turn return 0.5; std over all returns {1, 2, 0} =
    # sqrt(2/3); group h: all returns equal -> 0 (no division by ~0)
    s = math.sqrt(2 / 3)
    adv = turn_level_advantages([np.array([1.0, 2.0]), np.array([0.0]), np.array([1.0, 1.0])], ["g", "g", "h"],
                                eps=0.0)
    np.testing.assert_allclose(adv[0], [0.5 / s, 1.5 / s], rtol=1e-6)
    np.testing.assert_allclose(adv[1], [-0.5 / s], rtol=1e-6)
    np.testing.assert_allclose(adv[2], [0.0, 0.0], atol=0)
    # equal first-turn returns but different later turns: bounded (divided by the pooled std of {1, 2, 1, 1},
    # sqrt(3)/4, not by eps)
    adv2 = turn_level_advantages([np.array([1.0, 2.0]), np.array([1.0, 1.0])], ["g", "g"])
    np.testing.assert_allclose(adv2[0], [0.0, 1.0 / (math.sqrt(3) / 4 + 1e-6)], rtol=1e-6)
    mean_only = turn_level_advantages([np.array([1.0, 2.0]), np.array([0.0])], ["g", "g"], std_norm=False)
    np.testing.assert_allclose(mean_only[0], [0.5, 1.5])
    np.testing.assert_allclose(mean_only[1], [-0.5])


def test_stale_token_weights():
    versions = np.array([-1, 3, 5, 6])
    mask = np.array([0, 1, 1, 1], bool)
    # current version 8, eta 2: lags 5, 3, 2 on the loss tokens -> excess 3, 1, 0
    m, w = stale_token_weights(versions, mask, 8, 2, "keep")
    assert m.tolist() == mask.tolist() and w.tolist() == [1, 1, 1, 1]
    m, w = stale_token_weights(versions, mask, 8, 2, "drop")
    assert m.tolist() == [False, False, False, True] and w.tolist() == [1, 1, 1, 1]
    m, w = stale_token_weights(versions, mask, 8, 2, "downweight", decay=0.5)
    assert m.tolist() == mask.tolist()
    np.testing.assert_allclose(w, [1.0, 0.125, 0.5, 1.0])
    with pytest.raises(ValueError):
        stale_token_weights(versions, mask, 8, 2, "nope")


def test_lr_lambda_schedules():
    pytest.importorskip("deepspeed")
    from arl.learner.deepspeed_engine import lr_lambda

    const = lr_lambda("constant", 2, 10)
    assert [const(k) for k in range(4)] == [0.5, 1.0, 1.0, 1.0]
    lin = lr_lambda("linear", 0, 4, min_lr_ratio=0.2)
    assert [lin(k) for k in range(5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    cos = lr_lambda("cosine", 1, 3)
    assert [cos(k) for k in range(4)] == pytest.approx([1.0, 1.0, 0.5, 0.0], abs=1e-12)
    with pytest.raises(ValueError):
        lr_lambda("step", 0, 1)
