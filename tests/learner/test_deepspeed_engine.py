"""`PPOActor` on a `DeepSpeedEngine`, a tiny random Llama (CPU, gloo, single process).

DeepSpeed is initialised once per learner; the first `initialize` on a machine builds `deepspeed_shm_comm`
(~25-70 s, cached in ~/.cache/torch_extensions afterwards), later ones take ~1 s.
"""

from __future__ import annotations

import copy
import math
import os

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")

from safetensors.torch import load_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from arl.api.engine import TrainEngine  # noqa: E402
from arl.api.types import Trajectory  # noqa: E402
from arl.learner.batching import build_micro_batches  # noqa: E402
from arl.learner.actor import METRIC_KEYS, PPOActor  # noqa: E402
from arl.learner.ppo import decoupled_ppo_loss, group_advantages, token_logprobs  # noqa: E402
from tests.learner._build import make_actor  # noqa: E402

torch.set_num_threads(1)

VOCAB = 32
PROMPT = [1, 2, 3]
TARGET = 7


def tiny_model(seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=tie,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def make_traj(prompt, gen, *, lp, version, reward, gid):
    ids = list(prompt) + list(gen)
    mask = [0] * len(prompt) + [1] * len(gen)
    lps = np.zeros(len(ids), np.float32)
    lps[len(prompt):] = lp
    vers = np.full(len(ids), -1, np.int32)
    vers[len(prompt):] = version
    return Trajectory(ids, mask, lps, vers, reward, gid)


def random_batch(seed: int = 0, n_groups: int = 3, group_size: int = 4, version: int = 0):
    """Variable-length trajectories with behaviour logprobs near -log(VOCAB) (off-policy weights vary)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(n_groups):
        for k in range(group_size):
            p = rng.integers(1, VOCAB, size=int(rng.integers(2, 5)))
            gen = rng.integers(1, VOCAB, size=int(rng.integers(1, 7)))
            lp = -math.log(VOCAB) + rng.normal(0, 0.3, size=len(gen))
            reward = float(rng.integers(0, 2)) + 0.1 * k
            out.append(make_traj(p, gen, lp=lp, version=version, reward=reward, gid=f"g{g}"))
    return out


@pytest.fixture(scope="module")
def learner():
    return make_actor(tiny_model(0), lr=1e-3, max_tokens_per_mb=4096, seed=0)


def capture_grads(lrn: PPOActor) -> dict[str, torch.Tensor]:
    """Wrap engine.step so the accumulated (pre-clip) gradients are copied just before the optimizer runs."""
    grads: dict[str, torch.Tensor] = {}
    orig = lrn.engine.model_engine.step

    def step(*a, **kw):
        for n, p in lrn.engine.module.named_parameters():
            grads[n] = p.grad.detach().clone()
        return orig(*a, **kw)

    lrn.engine.model_engine.step = step
    return grads


def test_protocol_and_metrics_and_staleness(learner):
    assert isinstance(learner.engine, TrainEngine)
    v = learner.version
    batch = [
        make_traj(PROMPT, [5, 6], lp=-3.0, version=v - 3, reward=1.0, gid="a"),
        make_traj(PROMPT, [5, 9, 9], lp=-3.0, version=v - 1, reward=0.0, gid="a"),
        make_traj(PROMPT, [8], lp=-3.0, version=v, reward=0.5, gid="b"),
    ]
    # mixed versions within one trajectory (a request that spanned a weight update)
    batch[1].versions[-1] = v - 2
    m = learner.step(batch)
    assert set(METRIC_KEYS) <= set(m) and all(isinstance(x, float) for x in m.values())
    assert all(math.isfinite(x) for x in m.values())
    assert learner.version == v + 1
    assert m["head_offpolicyness"] == 3.0 and m["tail_offpolicyness"] == 0.0
    assert m["n_seqs"] == 3.0 and m["n_tokens"] == 6.0
    assert m["reward_mean"] == pytest.approx(0.5) and m["reward_std"] == pytest.approx(math.sqrt(1 / 6))
    assert m["grad_norm"] > 0 and m["step_seconds"] > 0 and m["tokens_per_s"] > 0
    assert 0.0 <= m["clip_frac"] <= 1.0 and 0.0 <= m["capped_frac"] <= 1.0
    assert m["approx_kl"] == pytest.approx(0.0, abs=1e-5)  # prox was just recomputed: ratio 1 on the first pass
    # group a: advantages +-1 (std-normalised), group b (single): 0 -> mean |adv| over 6 tokens = 5/6
    assert m["adv_abs_mean"] == pytest.approx(5 / 6, rel=1e-4)
    assert 0 < m["entropy"] <= math.log(VOCAB) + 1e-4


def test_reward_favouring_a_token_raises_its_probability():
    torch.manual_seed(1)
    lrn = make_actor(tiny_model(1), lr=3e-3, seed=1)
    ids = torch.tensor([PROMPT])

    def p_target():
        with torch.no_grad():
            lrn.engine.module.eval()
            return torch.softmax(lrn.engine.module(input_ids=ids).logits[0, -1].float(), -1)[TARGET].item()

    p0 = p_target()
    gen = torch.Generator().manual_seed(0)
    for step in range(6):
        with torch.no_grad():
            probs = torch.softmax(lrn.engine.module(input_ids=ids).logits[0, -1].float(), -1)
        # 16 samples, force a few TARGET so every group has signal; behaviour logprobs from the current policy
        toks = torch.multinomial(probs, 16, replacement=True, generator=gen)
        toks[:4] = TARGET
        batch = [
            make_traj(PROMPT, [int(x)], lp=float(probs[int(x)].log()), version=lrn.version,
                      reward=float(int(x) == TARGET), gid=f"s{step}g{i // 8}")
            for i, x in enumerate(toks)
        ]
        m = lrn.step(batch)
        assert m["capped_frac"] == 0.0
        assert m["imp_weight_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy data
    p1 = p_target()
    assert p1 > 2 * p0, (p0, p1)


def test_micro_batch_split_matches_single_batch_and_reference_gradient():
    base = tiny_model(2)
    batch = random_batch(seed=3)
    big = make_actor(copy.deepcopy(base), lr=1e-3, grad_clip=0.0, max_tokens_per_mb=4096)
    small = make_actor(copy.deepcopy(base), lr=1e-3, grad_clip=0.0, max_tokens_per_mb=12)
    assert len(build_micro_batches(batch, 4096)) == 1
    assert len(build_micro_batches(batch, 12)) >= 4

    # reference: the whole batch in plain torch, token-level mean over the batch
    ref_model = copy.deepcopy(base)
    ref_model.train()
    adv = group_advantages(torch.tensor([t.reward for t in batch]), [t.group_id for t in batch])
    (mb,) = build_micro_batches(batch, 4096, adv.tolist())
    logp = token_logprobs(ref_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits, mb.input_ids)
    ref_loss, _ = decoupled_ppo_loss(logp, logp.detach(), mb.logprobs, mb.advantages, mb.loss_mask)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}

    g_big, g_small = capture_grads(big), capture_grads(small)
    m_big, m_small = big.step(batch), small.step(batch)
    assert m_big["loss"] == pytest.approx(ref_loss.item(), rel=1e-5, abs=1e-7)
    assert m_small["loss"] == pytest.approx(m_big["loss"], rel=1e-5, abs=1e-7)
    assert m_small["grad_norm"] == pytest.approx(m_big["grad_norm"], rel=1e-5)
    for k in ("n_tokens", "clip_frac", "capped_frac", "entropy", "imp_weight_mean", "adv_abs_mean"):
        assert m_small[k] == pytest.approx(m_big[k], rel=1e-5, abs=1e-7), k
    for n in ref_grads:
        torch.testing.assert_close(g_big[n], ref_grads[n], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(g_small[n], g_big[n], rtol=1e-4, atol=1e-6)
    sd_b, sd_s = big.engine.module.state_dict(), small.engine.module.state_dict()
    for n in sd_b:
        torch.testing.assert_close(sd_s[n], sd_b[n], rtol=1e-4, atol=1e-6)
    # the step moved the weights
    assert any(not torch.equal(sd_b[n], base.state_dict()[n]) for n in sd_b)


def test_export_weights_roundtrip(learner, tmp_path):
    learner.step(random_batch(seed=5, version=learner.version))
    path = tmp_path / "w" / "model.safetensors"
    learner.engine.export_weights(str(path))
    assert path.exists() and not [f for f in os.listdir(path.parent) if f.startswith(".tmp")]
    fresh = tiny_model(123)
    fresh.load_state_dict(load_file(str(path)), strict=True)
    want = learner.engine.module.state_dict()
    got = fresh.state_dict()
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # overwrite in place (atomic replace)
    learner.engine.export_weights(str(path))
    assert sorted(os.listdir(path.parent)) == ["model.safetensors"]


def test_export_tied_embeddings(tmp_path):
    lrn = make_actor(tiny_model(4, tie=True), lr=1e-3)
    lrn.step(random_batch(seed=6))
    lrn.engine.export_weights(str(tmp_path / "tied.safetensors"))
    fresh = tiny_model(9, tie=True)
    fresh.load_state_dict(load_file(str(tmp_path / "tied.safetensors")), strict=True)
    for k, v in lrn.engine.module.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v), k


def test_save_load_restores_weights_optimizer_and_version(tmp_path):
    lrn = make_actor(tiny_model(7), lr=1e-3, version=10)
    lrn.step(random_batch(seed=8, version=10))
    lrn.engine.save(str(tmp_path / "ckpt"))
    saved = {k: v.clone() for k, v in lrn.engine.module.state_dict().items()}
    torch.manual_seed(1234)
    expected_rand = torch.rand(3)
    b = random_batch(seed=9, version=11)
    m_a = lrn.step(b)
    after_a = {k: v.clone() for k, v in lrn.engine.module.state_dict().items()}
    assert lrn.version == 12

    lrn.engine.load(str(tmp_path / "ckpt"))
    assert lrn.version == 11
    for k, v in lrn.engine.module.state_dict().items():
        assert torch.equal(v, saved[k]), k
    # the same step again gives the same result (optimizer moments restored too)
    m_b = lrn.step(b)
    assert m_b["loss"] == pytest.approx(m_a["loss"], rel=1e-6)
    for k, v in lrn.engine.module.state_dict().items():
        torch.testing.assert_close(v, after_a[k], rtol=0, atol=1e-7)
    # RNG state is restored to what it was at save time
    lrn.engine.load(str(tmp_path / "ckpt"))
    torch.manual_seed(1234)
    assert torch.equal(torch.rand(3), expected_rand)


@pytest.mark.parametrize("kw", [dict(zero_stage=2, max_tokens_per_mb=12), dict(zero_stage=3, max_tokens_per_mb=12),
                                dict(zero_stage=2, grad_clip=1e-3)])
def test_zero_stages_match_stage0(kw, tmp_path):
    """Stage 0 (fp32) clips in the engine, stages 1-3 in DeepSpeed: the same update, clipped or not."""
    base = tiny_model(11)
    batch = random_batch(seed=12)
    clip = kw.get("grad_clip", 1.0)
    ref = make_actor(copy.deepcopy(base), lr=1e-3, grad_clip=clip)
    lrn = make_actor(copy.deepcopy(base), lr=1e-3, **kw)
    unclipped = make_actor(copy.deepcopy(base), lr=1e-3, grad_clip=0.0)
    for _ in range(2):
        m_ref, m = ref.step(batch), lrn.step(batch)
        assert unclipped.step(batch)["grad_norm"] > clip  # the clip binds
        assert m["loss"] == pytest.approx(m_ref["loss"], rel=1e-4, abs=1e-6)
        assert m["grad_norm"] == pytest.approx(m_ref["grad_norm"], rel=1e-4)
    lrn.engine.export_weights(str(tmp_path / "z.safetensors"))
    sd = load_file(str(tmp_path / "z.safetensors"))
    ref_sd = ref.engine.module.state_dict()
    assert set(sd) == set(ref_sd)
    for k in ref_sd:
        torch.testing.assert_close(sd[k], ref_sd[k], rtol=1e-4, atol=1e-5)
    un = unclipped.engine.module.state_dict()  # clipping changed the update (Adam's second step sees the scale)
    assert any(not torch.allclose(un[k], ref_sd[k], rtol=1e-4, atol=1e-5) for k in ref_sd)


def test_engine_start_builds_no_deepspeed_op(tmp_path):
    """A learner's start compiles nothing: DeepSpeed's shared-memory comm op (25-70 s of gcc on a fresh machine)
    serves only its inference all-reduce, so `ensure_distributed` keeps it from being built. Its exit tears
    torch.distributed down first (`destroy_distributed`, registered at exit)."""
    import subprocess
    import sys

    code = ("import torch; torch.set_num_threads(1)\n"
            "from tests.learner.test_deepspeed_engine import tiny_model\n"
            "from tests.learner._build import make_actor\n"
            "a = make_actor(tiny_model())\n"
            "print('started', a.engine.world_size)\n"
            # the at-exit teardown (a gloo group left to finalization can abort the process: SIGABRT)
            "import atexit, torch.distributed as d, deepspeed.utils.groups as g\n"
            "atexit._run_exitfuncs()\n"
            "print('torn down', d.is_initialized(), g._WORLD_GROUP)\n")
    ext = tmp_path / "torch_extensions"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "PYTHONPATH": os.getcwd()}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "started 1" in out.stdout
    assert "torn down False None" in out.stdout
    built = [p.name for p in ext.rglob("*")] if ext.exists() else []
    assert not built, f"DeepSpeed built {built} at start"
