"""PPOActor options (on a DeepSpeedEngine) against hand-computed references: sequence-level aggregation, staleness at
consumption (drop / down-weight), KL to the frozen initial weights, turn-level discount, LR schedule."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from arl.api.types import Trajectory  # noqa: E402
from arl.learner.batching import build_micro_batches  # noqa: E402
from tests.learner._build import make_actor  # noqa: E402
from arl.learner.ppo import decoupled_ppo_loss, group_advantages, stale_token_weights, token_logprobs  # noqa: E402

torch.set_num_threads(1)
VOCAB = 32


def tiny(seed=0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=4, pad_token_id=0))


def traj(prompt, gen, *, version=0, reward=0.0, gid="g", lp=-3.0, turn_rewards=None):
    ids = list(prompt) + list(gen)
    mask = [0] * len(prompt) + [1] * len(gen)
    return Trajectory(ids, mask, [lp if m else 0.0 for m in mask], [version if m else -1 for m in mask], reward, gid,
                      turn_rewards=list(turn_rewards or []))


def on_policy(model, trajs):
    """Set behaviour logprobs to the model's own (so w = r = 1 on the first pass and loss = -weighted mean A)."""
    model.eval()
    with torch.no_grad():
        for t in trajs:
            ids = torch.from_numpy(t.input_ids.astype(np.int64))[None]
            lp = token_logprobs(model(input_ids=ids, use_cache=False).logits, ids)[0].numpy()
            t.logprobs = np.where(t.loss_mask.astype(bool), lp, 0.0).astype(np.float32)
    model.train()
    return trajs


def test_sequence_level_aggregation_by_hand():
    base = tiny(1)
    batch = on_policy(base, [traj([1, 2], [3], reward=1.0, gid="a"), traj([1, 2], [4, 5, 6, 7], reward=0.0, gid="a"),
                             traj([5], [6, 7], reward=2.0, gid="b"), traj([5], [8, 9, 9], reward=0.0, gid="b")])
    # std-normalised group advantages are +1 / -1 in both groups; sequence tokens 1, 4, 2, 3
    adv = [1.0, -1.0, 1.0, -1.0]
    n = [1, 4, 2, 3]
    tok = make_actor(copy.deepcopy(base), lr=1e-3, loss_agg="token")
    seq = make_actor(copy.deepcopy(base), lr=1e-3, loss_agg="seq")
    m_tok, m_seq = tok.step(batch), seq.step(batch)
    assert m_tok["loss"] == pytest.approx(-sum(a * k for a, k in zip(adv, n)) / sum(n), abs=1e-5)  # = 0.2
    assert m_seq["loss"] == pytest.approx(-sum(adv) / 4, abs=1e-5)  # = 0
    assert m_tok["imp_weight_mean"] == pytest.approx(1.0, abs=1e-5)


def test_stale_tokens_drop_matches_hand_masked_batch():
    base = tiny(2)
    v = 10
    batch = [traj([1, 2], [3, 4, 5], version=v - 1, reward=1.0, gid="a"),
             traj([1, 2], [6, 7], version=v - 4, reward=0.0, gid="a"),
             traj([3], [8, 9], version=v, reward=1.0, gid="b"),
             traj([3], [9, 9, 9], version=v - 2, reward=0.0, gid="b")]
    batch[0].versions[-1] = v - 3  # one stale token inside a fresh trajectory
    # eta = 2: tokens with lag > 2 are stale: traj 1 (lag 4, 2 tokens) and traj 0's last token (lag 3)
    hand = copy.deepcopy(batch)
    for t in hand:
        t.loss_mask = (t.loss_mask.astype(bool) & (v - t.versions <= 2)).astype(np.int8)
    drop = make_actor(copy.deepcopy(base), lr=1e-3, version=v, eta=2, stale_tokens="drop",
                            grad_clip=0.0)
    ref = make_actor(copy.deepcopy(base), lr=1e-3, version=v, grad_clip=0.0)
    m_drop, m_ref = drop.step(batch), ref.step(hand)
    assert m_drop["stale_token_frac"] == pytest.approx(3 / 10)
    assert m_drop["n_tokens"] == m_ref["n_tokens"] == 7.0
    assert m_drop["loss"] == pytest.approx(m_ref["loss"], rel=1e-6, abs=1e-8)
    assert m_drop["head_offpolicyness"] == 4.0  # reported as received, before the drop
    for (n, a), b in zip(drop.engine.module.state_dict().items(), ref.engine.module.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-7, msg=n)
    keep = make_actor(copy.deepcopy(base), lr=1e-3, version=v, eta=2)
    m_keep = keep.step(batch)
    assert m_keep["stale_token_frac"] == pytest.approx(3 / 10) and m_keep["n_tokens"] == 10.0


def test_stale_tokens_downweight_matches_plain_torch():
    base = tiny(3)
    v = 6
    batch = [traj([1, 2], [3, 4], version=v - 3, reward=1.0, gid="a"), traj([1], [5, 6, 7], version=v, gid="a"),
             traj([2, 2], [9], version=v - 5, reward=1.0, gid="b"), traj([4], [8, 8], version=v - 1, gid="b")]
    lrn = make_actor(copy.deepcopy(base), lr=1e-3, version=v, eta=1,
                           stale_tokens="downweight", stale_token_decay=0.5, packing=False)
    m = lrn.step(batch)
    # plain torch reference: weights 0.5**(lag - eta) = 0.25 (lag 3), 1, 0.0625 (lag 5), 1; token-level mean
    model = copy.deepcopy(base).train()
    adv = group_advantages(torch.tensor([t.reward for t in batch]), [t.group_id for t in batch]).tolist()
    w = [stale_token_weights(t.versions, t.loss_mask, v, 1, "downweight", 0.5)[1] for t in batch]
    assert [float(x[-1]) for x in w] == [0.25, 1.0, 0.0625, 1.0]
    (mb,) = build_micro_batches(batch, 4096, adv, token_weights=w)
    logp = token_logprobs(model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits, mb.input_ids)
    ref, _ = decoupled_ppo_loss(logp, logp.detach(), mb.logprobs, mb.advantages, mb.loss_mask,
                                token_weights=mb.token_weights)
    assert m["loss"] == pytest.approx(ref.item(), rel=1e-5, abs=1e-7)
    assert m["stale_token_frac"] == pytest.approx(3 / 8)


def test_kl_to_frozen_initial_weights():
    base = tiny(4)
    batch = [traj([1, 2], [3, 4, 5], reward=1.0, gid="a"), traj([1, 2], [6, 7], reward=0.0, gid="a")]
    lrn = make_actor(copy.deepcopy(base), lr=3e-2, kl_coef=0.5, kl_estimator="k3", grad_clip=0.0)
    no_kl = make_actor(copy.deepcopy(base), lr=3e-2, grad_clip=0.0)
    m0, n0 = lrn.step(batch), no_kl.step(batch)
    assert m0["kl_ref"] == pytest.approx(0.0, abs=1e-6)  # reference == current weights at the first step
    assert m0["loss"] == pytest.approx(n0["loss"], abs=1e-6)
    for _ in range(3):
        m = lrn.step(batch)
    assert m["kl_ref"] > 1e-4  # k3 >= 0, and the policy moved away from the reference
    for k, v in lrn.engine.ref_model.state_dict().items():  # the reference stays frozen at the initial weights
        assert torch.equal(v, base.state_dict()[k]), k
    assert all(not p.requires_grad for p in lrn.engine.ref_model.parameters())
    assert make_actor(copy.deepcopy(base), lr=1e-3).engine.ref_model is None  # no copy when KL is off


def test_turn_level_discount_advantages():
    base = tiny(5)
    # traj A: two turns (tokens 5,6 | context 3 | token 7), turn rewards (0, 1), gamma 0.5 -> returns (0.5, 1);
    # traj B: one turn, reward 0 -> (0). Baseline 0.25, pooled std sqrt(1/6):
    # A turn 1 = 0.25/s, A turn 2 = 0.75/s, B = -0.25/s
    a = Trajectory([1, 2, 5, 6, 3, 7], [0, 0, 1, 1, 0, 1], [0, 0, -3, -3, 0, -3], [-1, -1, 0, 0, -1, 0], 0.5, "g",
                   turn_rewards=[0.0, 1.0])
    b = Trajectory([1, 2, 5], [0, 0, 1], [0, 0, -3], [-1, -1, 0], 0.0, "g", turn_rewards=[0.0])
    lrn = make_actor(copy.deepcopy(base), lr=1e-3, turn_discount=0.5)
    m = lrn.step([a, b])
    s = math.sqrt(1 / 6)
    assert m["adv_abs_mean"] == pytest.approx((2 * 0.25 / s + 0.75 / s + 0.25 / s) / 4, rel=1e-4)
    assert m["turn_reward_mismatch"] == 0.0
    bad = Trajectory([1, 2, 5], [0, 0, 1], [0, 0, -3], [-1, -1, 0], 1.0, "h", turn_rewards=[0.0, 1.0])
    m2 = lrn.step([a, b, bad])  # mismatched turn rewards fall back to the scalar reward, counted
    assert m2["turn_reward_mismatch"] == 1.0 and math.isfinite(m2["loss"])


def _two_turn(reward: float, turn_rewards: list, gid: str, gamma=None) -> Trajectory:
    # turn 1 = tokens 5, 6 | context 3 | turn 2 = token 7
    return Trajectory([1, 2, 5, 6, 3, 7], [0, 0, 1, 1, 0, 1], [0, 0, -3, -3, 0, -3], [-1, -1, 0, 0, -1, 0], reward,
                      gid, turn_rewards=turn_rewards, turn_discount=gamma)


def test_the_agents_turn_discount_credits_its_turns_unless_the_config_overrides_it():
    lrn = make_actor(tiny(5), lr=1e-3)
    # group g: a retry that fixed a wrong first answer (reward 0.9, turns (0, 1)) and a first-answer success
    # (one turn); the agent says each turn is judged on its own (gamma 0). Returns: A (0, 1), B (1):
    # baseline = mean first-turn return 0.5, pooled std of (0, 1, 1) = sqrt(2/9)
    a = _two_turn(0.9, [0.0, 1.0], "g", gamma=0.0)
    b = Trajectory([1, 2, 5], [0, 0, 1], [0, 0, -3], [-1, -1, 0], 1.0, "g", turn_rewards=[1.0], turn_discount=0.0)
    # group h: no word from its agent -> one scalar per trajectory, as GRPO
    c, d = _two_turn(0.9, [0.0, 1.0], "h"), _two_turn(0.0, [0.0, 0.0], "h")
    adv, mismatched = lrn.advantages([a, b, c, d])
    s = math.sqrt(2 / 9)
    assert mismatched == 0
    np.testing.assert_allclose(adv[0], [0, 0, -0.5 / s, -0.5 / s, 0, 0.5 / s], rtol=1e-4)  # the wrong answer is pushed down
    np.testing.assert_allclose(adv[1], [0, 0, 0.5 / s], rtol=1e-4)
    assert np.isscalar(adv[2]) and np.isscalar(adv[3]) and adv[2] == pytest.approx(-adv[3]) and adv[2] > 0
    # the config's discount wins over the agent's, and applies to every trajectory with turn rewards
    adv2, _ = make_actor(tiny(5), lr=1e-3, turn_discount=1.0).advantages([a, b, c, d])
    assert all(not np.isscalar(x) for x in adv2)
    assert adv2[2][2] == pytest.approx(adv2[2][5]) and adv2[2][2] > 0  # reward-to-go 1 at both of C's turns
    np.testing.assert_allclose(adv2[0], 0.0, atol=1e-6)  # A and B are now worth the same at every turn
    # without any agent's word the default is unchanged: scalars only
    adv3, _ = lrn.advantages([c, d])
    assert all(np.isscalar(x) for x in adv3)


def test_a_group_credited_per_turn_counts_its_mismatched_trajectory():
    lrn = make_actor(tiny(5), lr=1e-3)
    ok = _two_turn(0.9, [0.0, 1.0], "g", gamma=0.0)
    bad = _two_turn(0.0, [0.0], "g", gamma=0.0)  # one turn reward for two turns: its scalar reward for both
    other = _two_turn(0.0, [0.0, 0.0], "g")  # no word from its agent, in a group credited per turn: same fallback
    adv, mismatched = lrn.advantages([ok, bad, other])
    assert mismatched == 2 and all(not np.isscalar(x) for x in adv)
    m = lrn.step([ok, bad, other])
    assert m["turn_reward_mismatch"] == 2.0 and math.isfinite(m["loss"])


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_lr_schedule_warmup_then_cosine(zero_stage):
    base = tiny(6)
    lrn = make_actor(copy.deepcopy(base), lr=1e-3, lr_schedule="cosine", warmup_steps=2, total_steps=4,
                           zero_stage=zero_stage)
    batch = [traj([1, 2], [3, 4], reward=1.0, gid="a"), traj([1, 2], [5], reward=0.0, gid="a")]
    lrs = [lrn.step(batch)["lr"] for _ in range(5)]
    assert lrs == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4, 0.0], abs=1e-12)


def test_bad_options_raise():
    for kw in (dict(loss_agg="x"), dict(kl_estimator="k2"), dict(dual_clip_c=0.5), dict(stale_tokens="drop"),
               dict(packed_attention="flash"), dict(lr_schedule="step"), dict(turn_discount=2.0)):
        with pytest.raises(ValueError):
            make_actor(tiny(0), **kw)


def test_proximal_and_update_forward_in_the_same_mode_with_dropout():
    """A model with dropout: the proximal recompute and the update's forward see the same network (dropout off in
    both), so with one minibatch the ratio is exactly 1 where the gradient is taken: nothing clipped, no KL."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, pad_token_id=0,
                                         attention_dropout=0.5))
    batch = [traj([1, 2], [3, 4, 5], reward=1.0, gid="a", lp=-0.5), traj([1, 2], [6, 7], reward=0.0, gid="a", lp=-4.0),
             traj([5], [6, 7, 8, 9], reward=1.0, gid="b", lp=-6.0), traj([5], [8], reward=0.0, gid="b", lp=-1.0)]
    actor = make_actor(model, lr=1e-3, eps_clip=0.01)
    m = actor.step(batch)
    assert m["approx_kl"] == 0.0 and m["clip_frac"] == 0.0 and m["dual_clip_frac"] == 0.0


def test_a_minibatch_with_every_token_dropped_takes_no_optimizer_step():
    """stale_tokens=drop can leave a minibatch without a loss token: it must not step (AdamW's weight decay and
    momentum would still move the weights)."""
    base = tiny(4)
    stale = [traj([1, 2], [3, 4], version=0, reward=r, gid="a") for r in (0.0, 1.0)]
    actor = make_actor(copy.deepcopy(base), lr=1e-2, weight_decay=0.1, version=5, eta=1, stale_tokens="drop",
                       minibatches=2)
    m = actor.step(stale)
    for (name, a), b in zip(actor.engine.module.state_dict().items(), base.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    assert m["n_tokens"] == 0 and m["empty_minibatches"] == 2.0
