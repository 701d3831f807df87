"""LoRA on the learner (`learner.lora`): only the adapters train, the reference is the base with them disabled,
exports carry the adapter payload, multi-rank and resume behave as with full fine-tuning."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("peft")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from arl.weights.adapter import LORA_A, LORA_B, is_adapter  # noqa: E402
from tests.learner._build import make_actor  # noqa: E402
from tests.learner.test_deepspeed_engine import random_batch, tiny_model  # noqa: E402

from .test_checkpoint_resume import _weights, _worker  # noqa: E402  (the resume test's worker and weights)
from .test_multirank import run_two_ranks_and_one  # noqa: E402

torch.set_num_threads(1)
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _train_fixed as tf  # noqa: E402


def _lora_actor(**kw):
    kw.setdefault("rank", 4)
    kw.setdefault("lr", 1e-3)  # the adapters' rate: 1e-2 (learner.lora.lr_scale 10)
    return make_actor(tiny_model(0), seed=0, **kw)


def test_only_the_adapters_train_and_hold_optimizer_state():
    base = {k: v.clone() for k, v in tiny_model(0).state_dict().items()}
    lrn = _lora_actor()
    trainable = [n for n, p in lrn.engine.module.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert {n.split(".")[-4] for n in trainable} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    opt_params = [p for g in lrn.engine.optimizer.param_groups for p in g["params"]]
    assert sum(p.numel() for p in opt_params) == sum(p.numel() for p in lrn.engine.module.parameters()
                                                     if p.requires_grad)
    for _ in range(2):
        lrn.step(random_batch(0))
    for s in lrn.engine.optimizer.state.values():  # Adam's moments: adapter-sized
        assert all(t.numel() <= 4 * 64 for t in s.values() if torch.is_tensor(t) and t.dim())
    sd = lrn.engine.module.state_dict()
    for k, v in base.items():  # the frozen base did not move
        key = f"base_model.model.{k}"
        key = key if key in sd else key.replace(".weight", ".base_layer.weight")
        assert torch.equal(sd[key], v), k
    assert any(sd[n].abs().sum() > 0 for n in trainable if ".lora_B." in n)  # B left zero: it learned


def test_adapters_train_at_lr_times_lr_scale_and_modules_to_save_at_lr():
    lrn = _lora_actor(lr=2e-3, modules_to_save=["lm_head"])
    groups = lrn.engine.optimizer.param_groups
    named = {id(p): n for n, p in lrn.engine.module.named_parameters()}
    assert [g["lr"] for g in groups] == pytest.approx([2e-2, 2e-3])
    assert groups[0]["params"] and all(".lora_" in named[id(p)] for p in groups[0]["params"])
    assert groups[1]["params"] and all("modules_to_save" in named[id(p)] for p in groups[1]["params"])
    assert lrn.step(random_batch(0))["lr"] == pytest.approx(2e-2)  # the metric is the adapters' rate
    # lr_scale=1: one rate, the first adapter step the same size as at 10x with a tenth of the rate (Adam's first
    # step is lr * sign(g)), so the scale is exactly a rate multiplier
    steps = []
    for lr, scale in ((1e-3, 10.0), (1e-2, 1.0)):
        a = _lora_actor(lr=lr, lr_scale=scale)
        before = {n: p.detach().clone() for n, p in a.engine.module.named_parameters() if p.requires_grad}
        a.step(random_batch(0))
        steps.append({n: p.detach() - before[n] for n, p in a.engine.module.named_parameters() if p.requires_grad})
    for n in steps[0]:
        torch.testing.assert_close(steps[0][n], steps[1][n])


def test_reference_logprobs_with_the_adapter_disabled_equal_the_base_model():
    lrn = _lora_actor(kl_coef=0.1)
    assert lrn.engine.ref_model is None  # no frozen copy
    batch = random_batch(1)
    for _ in range(3):
        lrn.step(random_batch(0))
    from arl.api.engine import TrainBatch

    ref = lrn.engine.forward_logprobs(TrainBatch(batch), reference=True)
    cur = lrn.engine.forward_logprobs(TrainBatch(batch))
    base = make_actor(tiny_model(0), seed=0).engine.forward_logprobs(TrainBatch(batch))  # the initial model
    for r, b in zip(ref, base):
        assert r.shape == b.shape
        assert float(abs(r - b).max()) < 1e-5
    assert max(float(abs(c - b).max()) for c, b in zip(cur, base)) > 1e-3  # the policy itself moved
    # and the adapters are on again after the reference pass
    again = lrn.engine.forward_logprobs(TrainBatch(batch))
    assert all((a == c).all() for a, c in zip(again, cur))


def test_unknown_target_module_is_refused_by_name():
    with pytest.raises(ValueError, match="no module of the model is named 'qkv_proj'"):
        _lora_actor(target_modules=["q_proj", "qkv_proj"])
    with pytest.raises(ValueError, match="modules_to_save: no module of the model is named 'head'"):
        _lora_actor(modules_to_save=["head"])


def test_export_is_the_adapter_payload(tmp_path):
    lrn = _lora_actor(alpha=8.0)
    lrn.step(random_batch(0))
    path = str(tmp_path / "v1.safetensors")
    lrn.engine.export_weights(path)
    sd = load_file(path)
    assert is_adapter(sd)
    assert all(k.endswith(LORA_A) or k.endswith(LORA_B) for k in sd)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in sd
    with safe_open(path, framework="pt") as f:
        assert f.metadata()["payload"] == "lora"
    full = sum(v.numel() for v in tiny_model(0).state_dict().values())
    assert sum(v.numel() for v in sd.values()) * 5 < full  # a fraction of the model
    # B carries the scaling alpha / r: merging the payload gives the adapted model's weights
    module = lrn.engine.module
    q = module.base_model.model.model.layers[0].self_attn.q_proj
    want = q.base_layer.weight + (q.lora_B["default"].weight @ q.lora_A["default"].weight) * (8.0 / 4)
    got = q.base_layer.weight + sd["model.layers.0.self_attn.q_proj.lora_B.weight"] @ \
        sd["model.layers.0.self_attn.q_proj.lora_A.weight"]
    torch.testing.assert_close(got, want)


class Args:
    zero_stage = 0
    steps = 4
    max_tokens_per_mb = 40
    lora_rank = 4


def test_resume_with_lora_is_bit_exact_and_checkpoints_only_the_adapters(tmp_path):
    groups = tf.make_groups(4 * tf.BATCH)
    straight = tf.make_learner(Args())
    w = _worker(straight, tmp_path / "a", total=4)
    w.buffer.extend(groups)
    asyncio.run(w.train())

    ckpt = str(tmp_path / "ckpt")
    first = tf.make_learner(Args())
    w1 = _worker(first, tmp_path / "b", total=2, every=2, ckpt=ckpt)
    w1.buffer.extend(groups)
    asyncio.run(w1.train())
    del first, w1
    model_file = [f for f in os.listdir(os.path.join(ckpt, "v2")) if "model_states" in f]
    saved = torch.load(os.path.join(ckpt, "v2", model_file[0]), map_location="cpu", weights_only=False)["module"]
    assert saved and all(".lora_" in k for k in saved)  # the frozen base is not in the checkpoint

    resumed = tf.make_learner(Args())  # fresh adapters, optimizer, scheduler
    w2 = _worker(resumed, tmp_path / "c", total=4, every=2, ckpt=ckpt)
    assert asyncio.run(w2.resume()) == 2
    assert is_adapter(load_file(str(tmp_path / "c" / "weights" / "v2.safetensors")))  # for the inference workers
    w2.buffer.extend(groups[w2.data_position["0"].low:])
    asyncio.run(w2.train())
    assert resumed.version == 4
    a, b = _weights(straight), _weights(resumed)
    assert any(not torch.equal(a[k], _weights(tf.make_learner(Args()))[k]) for k in a if ".lora_B." in k)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert resumed.engine.optimizer.param_groups[0]["lr"] == straight.engine.optimizer.param_groups[0]["lr"]


@pytest.mark.slow
def test_two_ranks_with_lora_equal_adapters_and_match_one_rank(tmp_path):
    _, two, one = run_two_ranks_and_one(tmp_path, ["--steps", "3", "--ranks", "--lora-rank", "4"])
    w0, w1, ref = load_file(f"{two}.rank0"), load_file(f"{two}.rank1"), load_file(f"{one}.rank0")
    moved = 0
    for k in ref:
        assert torch.equal(w0[k], w1[k]), k
        torch.testing.assert_close(w0[k], ref[k], rtol=1e-5, atol=1e-6)
        moved += ".lora_B." in k and bool(ref[k].abs().sum() > 0)
    assert moved
    full, full1 = load_file(f"{two}.full"), load_file(f"{one}.full")  # the exported adapter payloads
    assert is_adapter(full) and full.keys() == full1.keys()
    for k in full1:
        torch.testing.assert_close(full[k], full1[k], rtol=1e-5, atol=1e-6)


def test_config_refuses_bad_lora_settings_by_name(tmp_path):
    from arl.api.registry import INFERENCE_BACKENDS
    from arl.config import ConfigError, ExperimentConfig, parse_overrides

    cases = [
        (["learner.lora.rank=-1"], "learner.lora.rank must be an int >= 0"),
        (["learner.lora.rank=8", "learner.lora.alpha=0"], "learner.lora.alpha must be > 0"),
        (["learner.lora.rank=8", "learner.lora.lr_scale=0"], "learner.lora.lr_scale must be > 0"),
        (["learner.lora.rank=8", "learner.lora.target_modules=[]"], "learner.lora.target_modules must name"),
        (["learner.lora.rank=8", "learner.backend=sim"], "needs a learner that trains a model"),
    ]
    INFERENCE_BACKENDS.register("no-lora-here", lambda *a, **k: None)
    try:
        cases.append((["learner.lora.rank=8", "inference.backend=no-lora-here"],
                      "inference.backend=no-lora-here cannot serve LoRA adapters"))
        for overrides, message in cases:
            with pytest.raises(ConfigError, match=message):
                parse_overrides(ExperimentConfig, overrides)
    finally:
        INFERENCE_BACKENDS._items.pop("no-lora-here", None)
    # a model folder that exists: its module names are checked before any process starts
    tiny_model(0).save_pretrained(tmp_path / "m")
    with pytest.raises(ConfigError, match="no module of the model is named 'qkv'"):
        parse_overrides(ExperimentConfig, [f"model.path={tmp_path / 'm'}", "learner.lora.rank=8",
                                           "learner.lora.target_modules=[q_proj,qkv]"])
    ok = parse_overrides(ExperimentConfig, [f"model.path={tmp_path / 'm'}", "learner.lora.rank=8"])
    assert ok.learner.lora.enabled and parse_overrides(ExperimentConfig, []).learner.lora.rank == 0


def test_the_default_learner_and_engines_never_import_peft():
    code = ("import sys; import arl.learner.deepspeed_engine, arl.learner.backends, arl.inference.torch_engine, "
            "arl.inference.sglang_engine, arl.learner.export, arl.config; "
            "assert 'peft' not in sys.modules, 'peft imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(HERE))))
    assert r.returncode == 0, r.stderr[-2000:]


@pytest.mark.asyncio
@pytest.mark.parametrize("tie,saved", [(True, ["lm_head"]), (True, ["embed_tokens"]),
                                       (True, ["embed_tokens", "lm_head"]), (False, ["lm_head"])])
async def test_modules_to_save_on_a_tied_model_serves_the_policy_the_learner_trains(tmp_path, tie, saved):
    """A tied model (the default tiny one is) with a `modules_to_save` side of the tie: peft trains its own copy
    of that module while the other side keeps the base tensor, so the engine must change only the side the payload
    names. Its logprobs after the adapter update equal the learner model's."""
    import numpy as np

    from arl.inference.torch_engine import TorchEngine
    from arl.weights.adapter import LORA_A
    from tests.inference.test_torch_engine import req

    model = tiny_model(0, tie=tie)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    lrn = make_actor(model, seed=0, rank=4, lr=1e-3, alpha=8.0, modules_to_save=saved)
    module = lrn.engine.module
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the adapters and the saved copies move away from the base
        for name, p in module.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * (0.5 if ".lora_" in name else 0.2))
    path = str(tmp_path / "v1.safetensors")
    lrn.engine.export_weights(path)
    sent = load_file(path)
    assert is_adapter(sent) and any(k.endswith(LORA_A) for k in sent)
    assert {k for k in sent if not (k.endswith(LORA_A) or k.endswith(LORA_B))} == \
        {{"lm_head": "lm_head.weight", "embed_tokens": "model.embed_tokens.weight"}[s] for s in saved}

    engine = TorchEngine(tiny_model(0, tie=tie), pad_token_id=0, eos_token_id=None, max_batch_size=4,
                         max_context_len=64)
    try:
        await engine.update_weights(path, version=1)
        ids = np.random.RandomState(0).randint(1, 32, size=9).astype(np.int32)
        resp = await engine.agenerate(req("a", ids, greedy=True, max_new_tokens=6))
        assert resp.error is None, resp.error
        s = resp.samples[0]
    finally:
        await engine.close()
    seq = torch.tensor([[*ids.tolist(), *s.output_ids.tolist()]])
    module.eval()
    with torch.no_grad():
        logits = module(input_ids=seq).logits[0, len(ids) - 1:-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.output_ids.tolist())[:, None]).squeeze(1)
    np.testing.assert_allclose(s.output_logprobs, want.numpy(), atol=1e-4, rtol=0)


def test_merged_export_of_a_saved_tied_head_keeps_head_and_embedding_apart(tmp_path):
    """`export.merge_lora` on a tied model with `modules_to_save=[lm_head]`: the merged folder unties them in its
    config, so it loads as the policy the learner trained (head: the saved copy, embedding: the base)."""
    from transformers import AutoModelForCausalLM

    from arl.learner.export import export_final_lora
    from arl.models.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    tok = build_char_tokenizer()
    base_dir = save_model_dir(build_tiny_model(len(tok)), tok, str(tmp_path / "base"))
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    assert base.lm_head.weight is base.model.embed_tokens.weight
    head = torch.randn(base.lm_head.weight.shape, generator=torch.Generator().manual_seed(3))
    a = torch.randn(4, base.config.hidden_size) * 0.1
    b = torch.randn(base.config.hidden_size, 4) * 0.1
    payload = {"model.layers.0.self_attn.q_proj" + LORA_A: a, "model.layers.0.self_attn.q_proj" + LORA_B: b,
               "lm_head.weight": head}
    out = export_final_lora(payload, base_dir, str(tmp_path / "final"), merge=True)
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged"))
    torch.testing.assert_close(merged.lm_head.weight, head, rtol=0, atol=0)
    torch.testing.assert_close(merged.model.embed_tokens.weight, base.model.embed_tokens.weight, rtol=0, atol=0)
    q = base.model.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(merged.model.layers[0].self_attn.q_proj.weight, q + b @ a, rtol=1e-5, atol=1e-6)
