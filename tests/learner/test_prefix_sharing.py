"""Prefix sharing in packed rows: a group's chains share their prompt (and often their first turns); the model runs
each shared prefix once and gives the same logprobs, loss and gradients as the plain packed row."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from arl.api.engine import TrainBatch
from arl.api.types import Trajectory
from arl.learner.actor import split_minibatches
from arl.learner.batching import build_micro_batches, collate_packed, pack_groups, prefix_tree, scored_view

torch.set_num_threads(1)


def test_prefix_tree_numbers_each_prefix_once():
    seqs = [np.array([1, 2, 3, 4]), np.array([1, 2, 5]), np.array([1, 2, 3, 4]), np.array([1, 2]),
            np.array([7, 2]), np.array([1, 2, 5, 6])]
    ids, depth, index, owned = prefix_tree(seqs)
    assert ids.tolist() == [1, 2, 3, 4, 5, 7, 2, 6]
    assert depth.tolist() == [0, 1, 2, 3, 2, 0, 1, 3]
    assert index.tolist() == [0, 1, 2, 3, 0, 1, 4, 0, 1, 2, 3, 0, 1, 5, 6, 0, 1, 4, 7]
    assert owned.tolist() == [4, 1, 0, 0, 2, 1]  # a duplicate and a prefix of an earlier one add nothing
    # every position's node holds its token, and a sequence's own nodes are the last of its path, in order
    assert (ids[index] == np.concatenate(seqs)).all()
    at, nxt = 0, 0
    for s, o in zip(seqs, owned):
        path = index[at:at + len(s)]
        assert path[len(s) - o:].tolist() == list(range(nxt, nxt + o))
        at, nxt = at + len(s), nxt + o


def _traj(ids, n_prompt, gid, reward, rng):
    ids = np.array(ids)
    mask = np.array([0] * n_prompt + [1] * (len(ids) - n_prompt))
    return Trajectory(ids, mask, np.where(mask > 0, -1.0 + rng.normal(0, 0.3, len(ids)), 0.0),
                      np.where(mask > 0, 0, -1), float(reward), gid)


def _grouped_batch(seed: int = 0, groups: int = 4, chains: int = 6, vocab: int = 32) -> list[Trajectory]:
    """Chains sharing their group's prompt; some share a first answer and the feedback after it; one group
    has a duplicate chain and a chain that is a prefix of another (an exact repeat adds no node)."""
    rng = np.random.default_rng(seed)
    feedback = list(rng.integers(1, vocab, size=5))
    out = []
    for g in range(groups):
        prompt = list(rng.integers(1, vocab, size=int(rng.integers(3, 8))))
        firsts = [list(rng.integers(1, vocab, size=int(rng.integers(1, 4)))) for _ in range(2)]
        for c in range(chains):
            ids = prompt + firsts[c % 2]
            if rng.random() < 0.6:
                ids = ids + feedback + list(rng.integers(1, vocab, size=int(rng.integers(1, 4))))
            out.append(_traj(ids, len(prompt), f"g{g}", rng.random() < 0.5, rng))
    dup = out[0]
    out.append(_traj(dup.input_ids, int((dup.loss_mask == 0).sum()), "g0", 1.0 - dup.reward, rng))
    out.append(_traj(out[1].input_ids[:-1], int((out[1].loss_mask == 0).sum()), "g0", 1.0, rng))
    return out


def test_collate_with_shared_prefixes_runs_fewer_positions():
    trajs = _grouped_batch()
    (plain,) = build_micro_batches(trajs, 10_000, packed=True)
    (tree,) = build_micro_batches(trajs, 10_000, packed=True, share_prefixes=True)
    assert not plain.shares_prefixes and tree.shares_prefixes
    assert tree.computed_tokens < 0.8 * plain.computed_tokens  # the prompts (and shared turns) once
    # the row itself is a packed row of the same sequences (the loss reads it as before)
    assert sorted(tree.indices) == sorted(plain.indices) and tree.real_tokens == plain.real_tokens
    assert (tree.node_ids[0, tree.node_index] == tree.input_ids[0]).all()
    assert (tree.node_position_ids[0, tree.node_index] == tree.position_ids[0]).all()
    assert int(tree.node_owned.sum()) == tree.computed_tokens
    # a row with nothing shared carries no tree
    rng = np.random.default_rng(1)
    lone = collate_packed([_traj([1, 2, 3], 1, "a", 0, rng), _traj([4, 5], 1, "b", 1, rng)], [0, 1], [0.0, 0.0],
                          share_prefixes=True)
    assert not lone.shares_prefixes
    assert not collate_packed(trajs, [0, 1], [0.0, 0.0], share_prefixes=True).empty_like().shares_prefixes


@pytest.mark.parametrize("share", [False, True])
def test_scored_view_pairs_every_scored_token_with_its_predecessor(share):
    trajs = _grouped_batch(2)
    adv = [float(i) for i in range(len(trajs))]
    (mb,) = build_micro_batches(trajs, 10_000, adv, packed=True, share_prefixes=share)
    view, pos = scored_view(mb)
    lm = mb.loss_mask[0]
    assert int(view.loss_mask.sum()) == int(lm.sum()) and len(pos) < mb.real_tokens
    assert not view.shares_prefixes and view.packed and int(view.seq_lens.sum()) == len(pos)
    for f in ("input_ids", "loss_mask", "logprobs", "advantages", "versions", "position_ids"):
        assert torch.equal(getattr(view, f)[0], getattr(mb, f)[0, pos]), f
    scored = view.loss_mask[0].nonzero().squeeze(1)
    assert torch.equal(pos[scored - 1], pos[scored] - 1)  # the logits predicting each scored token are kept
    # per sequence: its scored tokens (what sequence-level aggregation counts)
    rows = view.loss_mask[0].split(view.seq_lens.tolist())
    assert [int(r.sum()) for r in rows] == [int(r.sum()) for r in lm.split(mb.seq_lens.tolist())]
    empty, p = scored_view(mb.empty_like())  # nothing scored: one position, no loss token
    assert p.tolist() == [0] and int(empty.loss_mask.sum()) == 0


def test_groups_stay_together():
    lens = [5, 6, 5, 9, 9, 2, 2, 2]
    gids = ["a", "a", "a", "b", "b", "c", "c", "c"]
    parts = split_minibatches(lens, 3, gids)
    assert sorted(map(sorted, parts)) == [[0, 1, 2], [3, 4], [5, 6, 7]]
    assert len(split_minibatches(lens, 4, gids)) == 4  # fewer groups than minibatches: sequence by sequence
    bins = pack_groups(lens, gids, 17)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(all(gids[i] == gids[b[0]] for i in b) or sum(lens[i] for i in b) <= 17 for b in bins)
    assert [0, 1, 2] in bins or [0, 1, 2, 5, 6, 7] in bins  # group a in one row
    assert sorted(map(sorted, pack_groups([10, 10, 1], ["a", "a", "b"], 12))) in ([[0, 2], [1]], [[0], [1, 2]])  # a is over budget


def _tiny(seed: int = 0, kv_heads: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=kv_heads, pad_token_id=0))


deepspeed = pytest.importorskip("deepspeed")

from tests.learner._build import make_actor  # noqa: E402


def _capture_grads(actor):
    grads: list[dict[str, torch.Tensor]] = []
    orig = actor.engine.model_engine.step

    def step(*a, **kw):
        grads.append({n: p.grad.detach().clone() for n, p in actor.engine.module.named_parameters()
                      if p.grad is not None})
        return orig(*a, **kw)

    actor.engine.model_engine.step = step
    return grads


LORA = pytest.param(dict(rank=4, alpha=8.0), marks=pytest.mark.skipif(
    __import__("importlib").util.find_spec("peft") is None, reason="peft not installed"))


@pytest.mark.parametrize("kw", [dict(), dict(minibatches=2, loss_agg="seq"), dict(max_tokens_per_mb=40, kv_heads=2),
                                LORA])
def test_shared_prefixes_give_the_same_logprobs_loss_and_gradients(kw, monkeypatch):
    kw = dict(kw)
    base = _tiny(2, kv_heads=kw.pop("kv_heads", 4))
    batch = _grouped_batch(3)
    plain = make_actor(copy.deepcopy(base), lr=1e-3, grad_clip=0.0, share_prefixes=False, **kw)
    shared = make_actor(copy.deepcopy(base), lr=1e-3, grad_clip=0.0, **kw)
    assert shared.engine.share_prefixes and not plain.engine.share_prefixes and shared.group_minibatches
    plain.group_minibatches = True  # the same minibatches (whole groups) on both sides
    lp_plain = plain.engine.forward_logprobs(TrainBatch(batch))
    positions = []
    forward = shared.engine.module.forward

    def spy(*a, **k):
        positions.append(k["input_ids"].shape[1])
        return forward(*a, **k)

    inner = shared.engine.module
    monkeypatch.setattr(inner, "forward", spy)
    lp_shared = shared.engine.forward_logprobs(TrainBatch(batch))
    assert sum(positions) < 0.8 * sum(len(t.input_ids) for t in batch)  # it did run fewer positions
    for a, b in zip(lp_plain, lp_shared):  # position 0 has no prefix: never read (the row's previous logits)
        np.testing.assert_allclose(b[1:], a[1:], rtol=1e-5, atol=1e-5)
    g_plain, g_shared = _capture_grads(plain), _capture_grads(shared)
    for _ in range(2):  # the second step on updated weights: ratios off 1
        m_plain, m_shared = plain.step(batch), shared.step(batch)
        assert m_shared["loss"] == pytest.approx(m_plain["loss"], rel=1e-4, abs=1e-6)
        for k in ("n_tokens", "clip_frac", "entropy", "imp_weight_mean", "adv_abs_mean", "grad_norm"):
            assert m_shared[k] == pytest.approx(m_plain[k], rel=1e-4, abs=1e-6), k
    assert len(g_plain) == len(g_shared) > 0
    for gp, gs in zip(g_plain, g_shared):
        for n in gp:
            torch.testing.assert_close(gs[n], gp[n], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("keeps_logits", [True, False])
def test_scored_only_logprobs_are_the_full_ones_under_the_loss_mask(keeps_logits):
    """The engine's logprobs at scored positions only (the LM head on them alone, or, for a model without
    ``logits_to_keep``, gathered from all logits) equal the full logprobs there and are 0 elsewhere."""
    batch = _grouped_batch(4)
    actor = make_actor(_tiny(3), lr=1e-3)
    assert actor.engine._keeps_logits
    actor.engine._keeps_logits = keeps_logits
    full = actor.engine.forward_logprobs(TrainBatch(batch))
    part = actor.engine.forward_logprobs(TrainBatch(batch), scored_only=True)
    for t, a, b in zip(batch, full, part):
        m = t.loss_mask.astype(bool)
        m[0] = False
        np.testing.assert_allclose(b[m], a[m], rtol=1e-5, atol=1e-6)
        assert not b[~m].any()
