"""Loss / advantage / logprob functions against values computed by hand on small tensors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from arl.api.types import Trajectory
from arl.learner.batching import build_micro_batches, collate_padded, split_by_token_budget
from arl.learner.ppo import (
    decoupled_ppo_loss,
    entropy_from_logits,
    group_advantages,
    shift_right,
    token_logprobs,
)

torch.set_num_threads(1)
L = math.log


def t(*x):
    return torch.tensor(x, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------- group advantages
def test_group_advantages_mean_only():
    r = t(1.0, 0.0, 3.0, 5.0, 2.0)
    a = group_advantages(r, ["a", "a", "b", "b", "c"], std_norm=False)
    # group a mean 0.5, group b mean 4, group c (single) mean 2
    torch.testing.assert_close(a, t(0.5, -0.5, -1.0, 1.0, 0.0))


def test_group_advantages_std_norm():
    r = t(1.0, 0.0, 0.0, 0.0, 3.0, 5.0)
    g = ["a", "a", "a", "a", "b", "b"]
    a = group_advantages(r, g, std_norm=True, eps=0.0)
    # group a: mean .25, population std sqrt(.1875); group b: mean 4, std 1
    s = math.sqrt(0.1875)
    torch.testing.assert_close(a, t(0.75 / s, -0.25 / s, -0.25 / s, -0.25 / s, -1.0, 1.0))
    # eps is added to the std
    a_eps = group_advantages(r, g, std_norm=True, eps=1.0)
    torch.testing.assert_close(a_eps[4:], t(-0.5, 0.5))


def test_group_advantages_uniform_group_is_zero_and_order_free():
    r = t(1.0, 7.0, 1.0, 3.0)
    a = group_advantages(r, ["x", "y", "x", "y"])
    assert a[0] == 0 and a[2] == 0  # equal rewards: no signal, no NaN
    torch.testing.assert_close(a[[1, 3]], t(1.0, -1.0), atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        group_advantages(r, ["x"])


# ----------------------------------------------------------------------------------------------- decoupled loss
def _loss(logp, prox, behav, adv, mask, **kw):
    return decoupled_ppo_loss(t(*logp), t(*prox), t(*behav), t(*adv), torch.tensor(mask, dtype=torch.bool), **kw)


def test_on_policy_loss_is_minus_mean_advantage_and_masked_tokens_ignored():
    lp = [-1.0, -2.0, -0.5, 9.0]
    loss, st = _loss(lp, lp, lp, [1.0, -3.0, 2.0, 100.0], [1, 1, 1, 0])
    assert loss.item() == pytest.approx(-(1.0 - 3.0 + 2.0) / 3)
    assert st["clip_frac"] == 0 and st["capped_frac"] == 0 and st["approx_kl"] == 0
    assert st["imp_weight_mean"].item() == pytest.approx(1.0)
    assert st["n_tokens"].item() == 3


def test_ratio_clipping_both_sides():
    # token 0: r = 1.5 > 1.2, A>0 -> clipped term 1.2 active; token 1: r = 0.5 < 0.8, A<0 -> clipped 0.8 active;
    # token 2: r = 1.5, A<0 -> unclipped (pessimistic) term 1.5; token 3: r = 0.5, A>0 -> unclipped 0.5.
    prox = [0.0, 0.0, 0.0, 0.0]
    lp = [L(1.5), L(0.5), L(1.5), L(0.5)]
    adv = [2.0, -1.0, -1.0, 3.0]
    loss, st = _loss([x - 1 for x in lp], [x - 1 for x in prox], [x - 1 for x in prox], adv, [1, 1, 1, 1])
    expected = -(2.0 * 1.2 + -1.0 * 0.8 + -1.0 * 1.5 + 3.0 * 0.5) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert st["clip_frac"].item() == pytest.approx(0.5)
    # approx_kl = mean(prox - logp)
    assert st["approx_kl"].item() == pytest.approx(-(L(1.5) + L(0.5) + L(1.5) + L(0.5)) / 4, rel=1e-6)
    assert st["ratio_mean"].item() == pytest.approx(1.0, rel=1e-6)


def test_gradient_zero_when_clipped_and_nonzero_when_not():
    logp = torch.tensor([L(1.5), L(1.5)], requires_grad=True)
    loss, _ = decoupled_ppo_loss(logp, torch.zeros(2), torch.zeros(2), t(1.0, -1.0), torch.ones(2, dtype=torch.bool))
    loss.backward()
    # token 0 clipped (A>0, r>1+eps) -> no gradient; token 1: d/dlogp of -A*r/2 = r/2 = 0.75
    torch.testing.assert_close(logp.grad, t(0.0, 0.75))


def test_behaviour_weight_multiplies_and_cap_filters():
    # prox - behav: w = 2, 4, 6 (capped at 5) ; current == prox so r = 1
    prox = [-1.0, -1.0, -1.0]
    behav = [-1.0 - L(2.0), -1.0 - L(4.0), -1.0 - L(6.0)]
    adv = [1.0, 1.0, 1.0]
    loss, st = _loss(prox, prox, behav, adv, [1, 1, 1], behav_imp_weight_cap=5.0)
    # capped token contributes 0 but still counts in the denominator (AReaL semantics)
    assert loss.item() == pytest.approx(-(2.0 + 4.0) / 3, rel=1e-6)
    assert st["capped_frac"].item() == pytest.approx(1 / 3)
    assert st["imp_weight_mean"].item() == pytest.approx(3.0, rel=1e-6)  # over uncapped tokens
    loss_nocap, st2 = _loss(prox, prox, behav, adv, [1, 1, 1], behav_imp_weight_cap=None)
    assert loss_nocap.item() == pytest.approx(-(2.0 + 4.0 + 6.0) / 3, rel=1e-6)
    assert st2["capped_frac"] == 0


def test_behaviour_weight_has_no_gradient_and_combines_with_clip():
    prox = torch.tensor([0.0, 0.0])
    behav = torch.tensor([-L(2.0), -L(2.0)])
    logp = torch.tensor([L(1.1), L(1.5)], requires_grad=True)
    loss, st = decoupled_ppo_loss(logp, prox, behav, t(1.0, 1.0), torch.ones(2, dtype=torch.bool), eps_clip=0.2)
    assert loss.item() == pytest.approx(-(2 * 1.1 + 2 * 1.2) / 2, rel=1e-6)
    loss.backward()
    # d/dlogp0 of -w*r/2 = -2*1.1/2; token 1 clipped
    torch.testing.assert_close(logp.grad, t(-1.1, 0.0))
    assert st["clip_frac"].item() == pytest.approx(0.5)


def test_naive_switch_uses_behaviour_as_old_policy():
    lp = [L(1.5), L(0.5)]
    behav = [0.0, 0.0]
    prox = [L(100.0), L(100.0)]  # ignored when naive
    loss, st = _loss(lp, prox, behav, [1.0, 1.0], [1, 1], naive=True, behav_imp_weight_cap=5.0)
    assert loss.item() == pytest.approx(-(1.2 + 0.5) / 2, rel=1e-6)
    assert st["imp_weight_mean"].item() == 1.0 and st["capped_frac"] == 0
    # the same inputs, decoupled: prox is the old policy and w = 100 > cap drops every token
    loss_d, st_d = _loss(lp, prox, behav, [1.0, 1.0], [1, 1], naive=False, behav_imp_weight_cap=5.0)
    assert loss_d.item() == 0.0 and st_d["capped_frac"].item() == 1.0
    # naive accepts prox_logp=None
    loss_n, _ = decoupled_ppo_loss(t(*lp), None, t(*behav), t(1.0, 1.0), torch.ones(2, dtype=torch.bool), naive=True)
    assert loss_n.item() == pytest.approx(loss.item())


def test_denominator_and_garbage_in_masked_positions():
    lp = t(-1.0, -1.0, 50.0)
    behav = t(-1.0, -1.0, -80.0)  # padding garbage: must not produce inf/NaN
    mask = torch.tensor([1, 1, 0], dtype=torch.bool)
    loss, _ = decoupled_ppo_loss(lp, lp, behav, t(1.0, 3.0, 1.0), mask, denominator=8.0)
    assert loss.item() == pytest.approx(-4.0 / 8)
    empty, st = decoupled_ppo_loss(lp, lp, behav, t(1.0, 1.0, 1.0), torch.zeros(3, dtype=torch.bool))
    assert empty.item() == 0.0 and st["n_tokens"] == 0 and math.isfinite(st["imp_weight_mean"].item())


def test_shape_mismatch_raises():
    with pytest.raises(ValueError):
        z = torch.zeros(3)
        decoupled_ppo_loss(z, z, torch.zeros(2), z, torch.ones(3, dtype=torch.bool))


# ----------------------------------------------------------------------------------------------- logprobs/entropy
def test_token_logprobs_alignment_and_temperature():
    logits = torch.tensor([[[0.0, L(3.0)], [L(2.0), 0.0], [5.0, 5.0]]])  # [1, T=3, V=2]
    ids = torch.tensor([[0, 1, 0]])
    lp = token_logprobs(logits, ids)
    # position 0: no prefix; position 1: token 1 under logits[0] -> 3/4; position 2: token 0 under logits[1] -> 2/3
    torch.testing.assert_close(lp, torch.tensor([[0.0, L(0.75), L(2 / 3)]]))
    lp_t = token_logprobs(logits, ids, temperature=2.0)
    # logits / 2: probs proportional to sqrt(1), sqrt(3)
    p1 = math.sqrt(3) / (1 + math.sqrt(3))
    p2 = math.sqrt(2) / (1 + math.sqrt(2))
    torch.testing.assert_close(lp_t, torch.tensor([[0.0, L(p1), L(p2)]]))
    ref = torch.log_softmax(logits[0, :-1] / 2.0, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
    torch.testing.assert_close(lp_t[0, 1:], ref)
    # a one-token row (a scored view of a micro-batch with nothing scored): its one position, 0
    torch.testing.assert_close(token_logprobs(logits[:, :1], ids[:, :1]), torch.zeros(1, 1))


def test_entropy_and_shift():
    logits = torch.tensor([[0.0, 0.0], [0.0, -1e4]])
    ent = entropy_from_logits(logits)
    torch.testing.assert_close(ent, t(L(2.0), 0.0))
    torch.testing.assert_close(shift_right(ent), t(0.0, L(2.0)))


# ----------------------------------------------------------------------------------------------- batching
def _traj(prompt, gen, v=0, lp=-1.0, reward=0.0, gid="g"):
    ids = list(prompt) + list(gen)
    mask = [0] * len(prompt) + [1] * len(gen)
    return Trajectory(
        input_ids=ids,
        loss_mask=mask,
        logprobs=[lp if m else 0.0 for m in mask],
        versions=[v if m else -1 for m in mask],
        reward=reward,
        group_id=gid,
    )


def test_split_by_token_budget():
    lens = [5, 2, 8, 3, 3]
    groups = split_by_token_budget(lens, 9)
    assert sorted(i for g in groups for i in g) == list(range(5))
    for g in groups:
        assert len(g) * max(lens[i] for i in g) <= 9 or len(g) == 1
    assert split_by_token_budget([20, 1], 4) == [[0], [1]]  # oversize sequence gets its own group
    assert split_by_token_budget([2, 2, 2], 100) == [[0, 1, 2]]


def test_split_by_token_budget_fewest_padded_tokens_in_as_many_groups():
    # filling longest first would take [8, 4] (16 padded) then [4, 4, 4] (12): 28 tokens for 20 real ones; the same
    # two groups split after the long one pad nothing
    assert split_by_token_budget([8, 4, 4, 4, 4], 16) == [[0], [1, 2, 3, 4]]
    assert split_by_token_budget([4, 8, 4, 4, 4], 16) == [[1], [0, 2, 3, 4]]
    rng = np.random.default_rng(0)
    for _ in range(300):  # never more groups than the greedy fill, never over budget, every index once
        lens = rng.integers(0, 25, int(rng.integers(0, 30))).tolist()
        budget = int(rng.integers(1, 60))
        groups = split_by_token_budget(lens, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lens)))
        greedy, i, srt = 0, 0, sorted((max(n, 1) for n in lens), reverse=True)
        while i < len(srt):
            i, greedy = i + max(1, min(len(srt) - i, budget // srt[i])), greedy + 1
        assert len(groups) == greedy
        assert all(len(g) == 1 or len(g) * max(max(lens[i] for i in g), 1) <= budget for g in groups)


def test_collate_alignment_and_padding():
    trajs = [_traj([1, 2], [5, 6, 7], v=3, lp=-0.5), _traj([9], [4], v=1, lp=-2.0), _traj([], [8, 8], v=0)]
    mb = collate_padded(trajs, [0, 1, 2], [1.5, -2.0, 4.0], pad_token_id=0)
    assert mb.input_ids.tolist() == [[1, 2, 5, 6, 7], [9, 4, 0, 0, 0], [8, 8, 0, 0, 0]]
    assert mb.attention_mask.tolist() == [[1] * 5, [1, 1, 0, 0, 0], [1, 1, 0, 0, 0]]
    # loss mask on generated tokens only; position 0 of the empty-prompt trajectory is dropped
    assert mb.loss_mask.int().tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0], [0, 1, 0, 0, 0]]
    assert mb.logprobs[0].tolist() == [0, 0, -0.5, -0.5, -0.5] and mb.logprobs[1, 1].item() == -2.0
    assert mb.versions.tolist() == [[-1, -1, 3, 3, 3], [-1, 1, -1, -1, -1], [-1, 0, -1, -1, -1]]
    assert mb.advantages.tolist() == [[0, 0, 1.5, 1.5, 1.5], [0, -2.0, 0, 0, 0], [0, 4.0, 0, 0, 0]]
    assert mb.n_loss_tokens == 5 and mb.seq_lens.tolist() == [5, 2, 2]


def test_collate_per_token_advantages_and_build():
    trajs = [_traj([1], [2, 3]), _traj([1, 1, 1], [2])]
    mbs = build_micro_batches(trajs, 4, [np.array([9.0, 1.0, 2.0], np.float32), 0.5])
    assert [mb.indices for mb in mbs] == [[1], [0]]  # longest first, 4-token budget: one per micro-batch
    assert mbs[1].advantages.tolist() == [[0.0, 1.0, 2.0]]  # value on a non-loss token is zeroed
    assert sum(mb.n_loss_tokens for mb in mbs) == 3
    with pytest.raises(ValueError):
        build_micro_batches(trajs, 4, [0.0])
