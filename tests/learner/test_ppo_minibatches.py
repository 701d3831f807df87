"""PPO minibatches: one proximal recompute per batch, one optimizer step per minibatch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")

from arl.learner.actor import split_minibatches  # noqa: E402
from tests.learner._build import make_actor  # noqa: E402
from tests.learner.test_learner_features import on_policy, tiny, traj  # noqa: E402


def batch(seed: int = 0, groups: int = 3, size: int = 4) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        for i in range(size):
            gen = rng.integers(1, 32, size=int(rng.integers(3, 12))).tolist()
            out.append(traj(rng.integers(1, 32, size=4).tolist(), gen, reward=float(rng.random() < 0.5),
                            gid=f"g{g}"))
    return out


def test_split_is_balanced_deterministic_and_complete():
    lengths = [50, 10, 40, 30, 20, 60, 5]
    parts = split_minibatches(lengths, 3)
    assert sorted(i for p in parts for i in p) == list(range(7)) and parts == split_minibatches(lengths, 3)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 15 and all(p == sorted(p) for p in parts)
    assert split_minibatches(lengths, 1) == [list(range(7))]
    assert len(split_minibatches([3, 4], 5)) == 2  # never an empty minibatch


def test_steps_per_batch_and_clip_only_binds_with_several():
    trajs = batch()
    model = tiny()
    on_policy(model, trajs)
    one = make_actor(copy.deepcopy(model), lr=3e-2, seed=0)
    four = make_actor(copy.deepcopy(model), lr=3e-2, seed=0, minibatches=4)
    m1, m4 = one.step(trajs), four.step(trajs)
    assert one.version == four.version == 1  # one policy version per batch either way
    assert one.engine.model_engine.global_steps == 1 and four.engine.model_engine.global_steps == 4
    assert m1["clip_frac"] == 0.0  # one step: pi == pi_prox where the gradient is taken, the ratio is exactly 1
    assert m4["clip_frac"] > 0.0  # later minibatches see pi move off pi_prox: the clip is a trust region
    assert m4["n_seqs"] == m1["n_seqs"] == len(trajs) and m4["n_tokens"] == m1["n_tokens"]


def test_minibatch_steps_equal_sequential_steps_on_the_parts():
    """Naive PPO does not use the proximal policy, so k minibatch steps on one batch must equal k train steps on
    the parts (with the whole batch's advantages)."""
    trajs = batch(seed=1)
    model = tiny(seed=1)
    on_policy(model, trajs)
    kw = dict(lr=1e-2, seed=0, naive_ppo=True, max_tokens_per_mb=24)
    a = make_actor(copy.deepcopy(model), minibatches=2, **kw)
    b = make_actor(copy.deepcopy(model), **kw)
    adv, _ = a.advantages(trajs)
    by_id = {id(t): v for t, v in zip(trajs, adv)}
    b.advantages = lambda bt: ([by_id[id(t)] for t in bt], 0)
    a.step(trajs)
    assert a.group_minibatches  # whole groups per minibatch (the engine shares their prefixes)
    for part in split_minibatches([len(t.input_ids) for t in trajs], 2, [t.group_id for t in trajs]):
        b.step([trajs[i] for i in part])
    wa, wb = a.engine.module.state_dict(), b.engine.module.state_dict()
    moved = False
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-5, atol=1e-6)
        moved |= not torch.equal(wa[k], model.state_dict()[k])
    assert moved


def test_bad_minibatch_count_raises():
    with pytest.raises(ValueError, match="minibatches"):
        make_actor(tiny(), minibatches=0)


def _counting(actor) -> list:
    calls: list = []
    inner = actor.engine.forward_logprobs

    def counted(batch, *a, **kw):
        calls.append(len(batch))
        return inner(batch, *a, **kw)

    actor.engine.forward_logprobs = counted
    return calls


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_first_minibatch_prox_comes_from_its_update_forward(kl_coef):
    """The first minibatch's proximal logprobs are its own update forward's (no forward of their own); the step
    is the step computed with a separate proximal forward, and naive PPO asks for no proximal logprobs at all."""
    trajs = batch(seed=2)
    model = tiny(seed=2)
    on_policy(model, trajs)
    kw = dict(lr=3e-2, seed=0, minibatches=4, kl_coef=kl_coef)
    own, sep = make_actor(copy.deepcopy(model), **kw), make_actor(copy.deepcopy(model), **kw)
    sep.engine.prox_from_update = False
    calls_own, calls_sep = _counting(own), _counting(sep)
    first = len(own.prepare(trajs).minibatches[0])
    forwards = []
    inner = own.engine._forward_logits
    own.engine._forward_logits = lambda mb, *a, **k: forwards.append(len(mb.indices)) or inner(mb, *a, **k)
    m_own, m_sep = own.step(trajs), sep.step(trajs)
    # the three minibatches' proximal logprobs in one forward (within the token budget), then four updates
    assert len(forwards) == 1 + (1 if kl_coef else 0) + 4 and forwards[0] == len(trajs) - first
    # one forward_logprobs call per kind of logprobs over every minibatch that needs them (the reference's too)
    n = len(trajs)
    assert calls_sep == [n] + ([n] if kl_coef else []) and calls_own == [n - first] + ([n] if kl_coef else [])
    for k in ("loss", "clip_frac", "approx_kl", "imp_weight_mean", "entropy", "grad_norm"):
        assert m_own[k] == pytest.approx(m_sep[k], rel=1e-4, abs=1e-6), k
    assert m_own["clip_frac"] > 0.0
    for p, q in zip(own.engine.model_engine.module.parameters(), sep.engine.model_engine.module.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6)
    naive = make_actor(copy.deepcopy(model), **{**kw, "naive_ppo": True})
    calls_naive = _counting(naive)
    naive.step(trajs)
    assert calls_naive == ([n] if kl_coef else [])
