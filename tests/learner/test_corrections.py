"""Each off-policy correction against its formula, written out token by token on hand-built logprobs: the loss and
its gradient with respect to the current logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from arl.config import PPOConfig
from arl.learner.corrections import Corrections, mismatch_stats, per_sequence
from arl.learner.ppo import decoupled_ppo_loss
from arl.utils.errors import ConfigError

# two sequences in one packed row: tokens 1-3 are sequence 0, tokens 5-7 sequence 1 (0 and 4 carry no logprob)
MASK = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 1]], dtype=torch.bool)
SEQ = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]])
LOGP0 = [0.0, -1.0, -0.5, -2.0, 0.0, -0.3, -1.2, -0.8]
PROX = [0.0, -1.1, -0.4, -2.5, 0.0, -0.3, -1.0, -0.9]
BEHAV = [0.0, -1.3, -0.4, -0.5, 0.0, -0.35, -1.1, -0.9]  # token 3: w = e^-2 (far below 1); the rest near 1
ADV = [0.0, 1.0, 1.0, 1.0, 0.0, -0.5, -0.5, -0.5]
TOKENS = [1, 2, 3, 5, 6, 7]
SEQS = {0: [1, 2, 3], 1: [5, 6, 7]}


def run(correction: Corrections, naive: bool = False, cap: float | None = 5.0, eps: float = 0.2):
    logp = torch.tensor([LOGP0], dtype=torch.float64, requires_grad=True)
    loss, stats = decoupled_ppo_loss(
        logp, torch.tensor([PROX], dtype=torch.float64), torch.tensor([BEHAV], dtype=torch.float64),
        torch.tensor([ADV], dtype=torch.float64), MASK, eps_clip=eps, behav_imp_weight_cap=cap, naive=naive,
        correction=correction, seq_index=SEQ)
    loss.backward()
    return float(loss), logp.grad[0].tolist(), stats


def reference(token_loss, keep=None):
    """The loss (token mean over the 6 loss tokens, masked ones counted in the denominator) and its gradient, with
    autograd on a per-token formula written with Python floats around one tensor per token."""
    x = [torch.tensor(LOGP0[t], dtype=torch.float64, requires_grad=True) for t in range(8)]
    total = sum(token_loss(t, x) for t in TOKENS if keep is None or keep(t))
    total = total / len(TOKENS)
    total.backward()
    return float(total), [float(x[t].grad) if x[t].grad is not None else 0.0 for t in range(8)]


def w(t: int) -> float:
    return math.exp(PROX[t] - BEHAV[t])


def ppo_term(t, x, eps=0.2):
    r = torch.exp(x[t] - PROX[t])
    return torch.maximum(-ADV[t] * r, -ADV[t] * r.clamp(1 - eps, 1 + eps))


def check(c: Corrections, token_loss, keep=None, **kw):
    loss, grad, stats = run(c, **kw)
    ref_loss, ref_grad = reference(token_loss, keep)
    assert loss == pytest.approx(ref_loss, abs=1e-12)
    assert grad == pytest.approx(ref_grad, abs=1e-12)
    return stats


def test_no_correction_is_areal_decoupled_ppo_with_the_cap_filter():
    stats = check(Corrections(), lambda t, x: w(t) * ppo_term(t, x), keep=lambda t: w(t) <= 5.0)
    check(Corrections(), lambda t, x: w(t) * ppo_term(t, x), keep=lambda t: w(t) <= 1.05, cap=1.05)
    assert float(stats["capped_frac"]) == 0.0


def test_tis_truncates_the_behaviour_weight_per_token_and_replaces_the_cap():
    c = Corrections(frozenset({"tis"}), tis_cap=1.1)
    check(c, lambda t, x: min(w(t), 1.1) * ppo_term(t, x), cap=1.05)  # the cap filters nothing: truncation instead


def test_seq_tis_weighs_each_sequence_by_its_truncated_product():
    c = Corrections(frozenset({"seq_tis"}), seq_threshold=1.5)
    seq_w = {s: min(math.prod(w(t) for t in ts), 1.5) for s, ts in SEQS.items()}
    check(c, lambda t, x: seq_w[0 if t < 4 else 1] * ppo_term(t, x))
    assert seq_w[0] < 1.0 < seq_w[1] or seq_w[1] == 1.5


def test_mis_masks_tokens_outside_the_band_and_keeps_them_in_the_denominator():
    c = Corrections(frozenset({"mis"}), mis_threshold=2.0)
    stats = check(c, lambda t, x: w(t) * ppo_term(t, x), keep=lambda t: 0.5 <= w(t) <= 2.0)
    assert float(stats["capped_frac"]) == pytest.approx(1 / 6)  # token 3 (w = e^-2)


def test_seq_mis_masks_whole_sequences():
    c = Corrections(frozenset({"seq_mis"}), seq_threshold=1.2)
    prod = {s: math.prod(w(t) for t in ts) for s, ts in SEQS.items()}
    assert not 1 / 1.2 <= prod[0] <= 1.2 and 1 / 1.2 <= prod[1] <= 1.2
    stats = check(c, lambda t, x: w(t) * ppo_term(t, x), keep=lambda t: t > 4)
    assert float(stats["capped_frac"]) == pytest.approx(0.5)


def test_geo_mask_uses_the_geometric_mean_of_the_sequence():
    geo = {s: math.exp(sum(PROX[t] - BEHAV[t] for t in ts) / len(ts)) for s, ts in SEQS.items()}
    g = 1.06
    assert not 1 / g <= geo[0] <= g and 1 / g <= geo[1] <= g
    check(Corrections(frozenset({"geo_mask"}), geo_threshold=g), lambda t, x: w(t) * ppo_term(t, x),
          keep=lambda t: t > 4)


def test_icepop_masks_tokens_outside_its_band_and_composes_with_tis():
    c = Corrections(frozenset({"icepop"}), icepop_band=(0.5, 1.1))
    check(c, lambda t, x: w(t) * ppo_term(t, x), keep=lambda t: 0.5 <= w(t) <= 1.1)
    both = Corrections(frozenset({"icepop", "tis"}), icepop_band=(0.5, 1.5), tis_cap=1.1)
    check(both, lambda t, x: min(w(t), 1.1) * ppo_term(t, x), keep=lambda t: 0.5 <= w(t) <= 1.5)


def test_cispo_clips_a_stop_gradient_weight_and_every_token_keeps_its_gradient():
    c = Corrections(frozenset({"cispo"}), cispo_eps=(1.0, 0.1))

    def tok(t, x):
        r = math.exp(LOGP0[t] - PROX[t])
        return -ADV[t] * w(t) * min(max(r, 0.0), 1.1) * x[t]  # the clipped weight is a constant

    _, grad, stats = run(c)
    check(c, tok, keep=lambda t: w(t) <= 5.0)
    assert all(g != 0.0 for t, g in enumerate(grad) if t in TOKENS)  # PPO's clip would zero some of these
    assert float(stats["clip_frac"]) > 0


def test_cispo_in_naive_mode_weighs_against_the_behaviour_policy():
    c = Corrections(frozenset({"cispo"}))

    def tok(t, x):
        r = math.exp(LOGP0[t] - BEHAV[t])
        return -ADV[t] * min(r, 5.0) * x[t]

    check(c, tok, naive=True)


def test_gspo_clips_the_length_normalised_sequence_ratio():
    c = Corrections(frozenset({"gspo"}), gspo_eps=(0.05, 0.05))

    def tok(t, x):
        ts = SEQS[0 if t < 4 else 1]
        s = torch.exp(sum(x[u] - PROX[u] for u in ts) / len(ts))
        return w(t) * torch.maximum(-ADV[t] * s, -ADV[t] * s.clamp(0.95, 1.05))

    stats = check(c, tok)
    assert float(stats["clip_frac"]) > 0  # sequence 0's ratio leaves the tight band


def test_gspo_composes_with_a_sequence_mask():
    c = Corrections(frozenset({"gspo", "seq_mis"}), gspo_eps=(0.5, 0.5), seq_threshold=1.2)

    def tok(t, x):
        ts = SEQS[1]
        s = torch.exp(sum(x[u] - PROX[u] for u in ts) / len(ts))
        return w(t) * torch.maximum(-ADV[t] * s, -ADV[t] * s.clamp(0.5, 1.5))

    check(c, tok, keep=lambda t: t > 4)


def test_behaviour_corrections_refuse_naive_ppo_and_the_config_says_why():
    with pytest.raises(ValueError, match="naive"):
        run(Corrections(frozenset({"icepop"})), naive=True)
    with pytest.raises(ConfigError, match="naive_ppo"):
        PPOConfig(correction=["tis"], naive_ppo=True)
    with pytest.raises(ConfigError, match="did you mean icepop"):
        PPOConfig(correction=["icepoop"])
    with pytest.raises(ConfigError, match="choose one"):
        PPOConfig(correction=["cispo", "gspo"])
    with pytest.raises(ConfigError, match="icepop_band"):
        PPOConfig(correction=["icepop"], icepop_band=[2.0, 1.0])
    assert PPOConfig(correction="tis, icepop").correction == ["tis", "icepop"]  # a string on the command line
    assert Corrections.from_config(PPOConfig(correction=["gspo"])).objective == "gspo"


def test_per_sequence_sums_and_means_over_masked_tokens_only():
    x = torch.arange(8, dtype=torch.float64).view(1, 8)
    assert per_sequence(x, SEQ, MASK)[0].tolist() == [6.0] * 4 + [18.0] * 4
    assert per_sequence(x, SEQ, MASK, mean=True)[0].tolist() == [2.0] * 4 + [6.0] * 4


def test_mismatch_stats_count_only_tokens_of_the_current_version():
    train = torch.tensor([[0.0, -1.0, -1.0, -1.0]])
    behav = torch.tensor([[0.0, -1.0, -1.5, -3.0]])
    versions = torch.tensor([[-1, 4, 4, 3]])
    mask = torch.tensor([[False, True, True, True]])
    mm = mismatch_stats(train, behav, versions, mask, version=4, threshold=0.4)
    d = 0.5  # token 2 only differs among version-4 tokens; token 3 (version 3, d = 2) is a policy lag, not noise
    assert mm["mismatch_tokens"] == 2
    assert mm["mismatch_kl_sum"] == pytest.approx(math.expm1(d) - d)
    assert mm["mismatch_over"] == 1 and mm["mismatch_max_abs"] == pytest.approx(0.5)
    assert mismatch_stats(None, behav, versions, mask, 4, 0.4)["mismatch_tokens"] == 0
