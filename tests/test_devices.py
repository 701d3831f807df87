"""Where the engine and the learner run, and in which dtype: `inference.dtype`, `learner.device`, and the weight
broadcast's backend when inference and the learner share a GPU (scripts/gpu_check.sh runs them on one)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from arl.config import ConfigError, InferenceConfig, parse_overrides, resolve_weights, shared_gpu, weights_backend
from arl.config import ExperimentConfig


def cfg(*overrides: str) -> ExperimentConfig:
    return parse_overrides(ExperimentConfig, list(overrides))


BROADCAST = ("weights.transport=broadcast",)


def test_colocated_broadcast_goes_by_disk():
    # one GPU: inference on cuda (= cuda:0), learner rank 0 on GPU 0: NCCL cannot pair them, auto goes by disk
    for extra in ((), ("learner.num_ranks=2", "learner.batch_size=16")):
        c = cfg(*BROADCAST, "inference.device=cuda", *extra)
        run, note = resolve_weights(c)
        assert shared_gpu(c) and run.weights.transport == "disk" and "by disk" in note
    # a GPU of its own, or a learner on the CPU: NCCL broadcast as before
    for c in (cfg(*BROADCAST, "inference.device=cuda:1"), cfg(*BROADCAST, "inference.device=cuda", "learner.device=cpu")):
        run, note = resolve_weights(c)
        assert shared_gpu(c) is None and note is None and weights_backend(run) == "nccl"
    assert weights_backend(cfg(*BROADCAST)) == "gloo"  # CPU inference


def test_explicit_nccl_on_a_shared_gpu_is_refused():
    with pytest.raises(ConfigError, match="Duplicate GPU detected"):
        cfg(*BROADCAST, "inference.device=cuda", "weights.backend=nccl")
    cfg(*BROADCAST, "inference.device=cuda:1", "weights.backend=nccl")  # GPUs of their own: fine
    cfg("inference.device=cuda", "weights.backend=nccl")  # transport=disk: no group is formed


def test_device_and_dtype_keys_are_checked():
    c = cfg("inference.dtype=bfloat16", "learner.device=cuda")
    assert c.inference.dtype == "bfloat16" and c.learner.device == "cuda"
    with pytest.raises(ConfigError, match="learner.device"):
        cfg("learner.device=gpu")
    with pytest.raises(ConfigError, match="inference.dtype"):
        cfg("inference.dtype=fp8")


def test_torch_backend_loads_the_model_in_inference_dtype(tmp_path):
    from arl.api.types import GenerateRequest, GenerationConfig
    from arl.inference.factory import build_engine
    from arl.models.tiny import build_char_tokenizer, build_tiny_model, save_model_dir

    tok = build_char_tokenizer()
    path = save_model_dir(build_tiny_model(len(tok), hidden_size=32, num_layers=1, num_heads=2,
                                           intermediate_size=64, seed=0), tok, str(tmp_path / "m"))
    engine = build_engine(path, InferenceConfig(dtype="bfloat16", max_batch_size=4), seed=0)

    async def go() -> None:
        try:
            resp = await engine.agenerate(GenerateRequest("q", np.array([3, 4, 5], np.int32),
                                                          GenerationConfig(max_new_tokens=4)))
            assert resp.error is None and len(resp.samples[0].output_ids) >= 1
            await engine.update_weights(path, 1)  # the fp32 file is cast to bf16 on the way in
        finally:
            await engine.close()

    asyncio.run(go())
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    assert engine.version == 1


def test_learner_device_cuda_without_a_gpu_fails_clearly():
    pytest.importorskip("deepspeed")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    from transformers import LlamaConfig, LlamaForCausalLM

    from arl.config import DeepSpeedConfig, OptimizerConfig
    from arl.learner.deepspeed_engine import DeepSpeedEngine

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(RuntimeError, match="learner.device=cuda, but torch sees no CUDA device"):
        DeepSpeedEngine(model, OptimizerConfig(), DeepSpeedConfig(), device="cuda")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        DeepSpeedEngine(model, OptimizerConfig(), DeepSpeedConfig(), device="gpu")
