"""The train-inference mismatch monitor sees an engine that decodes in lower precision than the learner trains.

The same weights sample through the embedded torch engine twice, once in float32 (the learner's precision) and once
in bfloat16; the learner's step over each batch reports `mismatch_kl` on the tokens of its current version. Only the
engine's numerics differ, and the monitor must tell them apart by orders of magnitude."""

from __future__ import annotations

import asyncio
import copy

import numpy as np
import torch

from arl.api.types import GenerateRequest, GenerationConfig, Trajectory
from arl.inference.torch_engine import TorchEngine

from ._build import make_actor
from .test_deepspeed_engine import VOCAB, tiny_model


async def sample(model: torch.nn.Module, prompts: list[np.ndarray], n: int) -> list[Trajectory]:
    engine = TorchEngine(model.eval(), pad_token_id=0, eos_token_id=None, max_batch_size=64, max_context_len=64,
                         seed=0)
    try:
        out = await asyncio.gather(*(engine.agenerate(GenerateRequest(
            qid=f"q{i}", input_ids=p, gconfig=GenerationConfig(n=n, max_new_tokens=12, temperature=1.0)))
            for i, p in enumerate(prompts)))
    finally:
        await engine.close()
    trajs = []
    for i, (p, resp) in enumerate(zip(prompts, out)):
        assert resp.error is None
        for k, s in enumerate(resp.samples):
            ids = np.concatenate([p, s.output_ids])
            mask = np.r_[np.zeros(len(p)), np.ones(len(s.output_ids))].astype(np.int8)
            lps = np.r_[np.zeros(len(p)), s.output_logprobs].astype(np.float32)
            vers = np.r_[np.full(len(p), -1), s.output_versions].astype(np.int32)
            trajs.append(Trajectory(ids, mask, lps, vers, float(k % 2), f"g{i}"))
    return trajs


def step_mismatch(policy: torch.nn.Module, trajs: list[Trajectory]) -> dict[str, float]:
    actor = make_actor(copy.deepcopy(policy), version=0, lr=1e-6)
    return actor.step(trajs)


def test_a_bfloat16_engine_moves_the_mismatch_monitor():
    policy = tiny_model(seed=3).float()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, VOCAB, size=5).astype(np.int32) for _ in range(4)]
    same = asyncio.run(sample(copy.deepcopy(policy), prompts, n=4))
    low = asyncio.run(sample(copy.deepcopy(policy).to(torch.bfloat16), prompts, n=4))

    st_same, st_low = step_mismatch(policy, same), step_mismatch(policy, low)
    n_gen = sum(int(t.loss_mask.sum()) for t in same)
    assert st_same["mismatch_tokens"] == n_gen == st_low["mismatch_tokens"]  # every token is of version 0
    assert st_same["mismatch_kl"] < 1e-8 and st_same["mismatch_max_abs"] < 1e-4
    assert st_low["mismatch_kl"] > 1e3 * max(st_same["mismatch_kl"], 1e-12)
    assert st_low["mismatch_max_abs"] > 1e-3
    assert st_same["mismatch_frac"] == 0.0


def test_tokens_of_older_versions_are_not_mismatch():
    policy = tiny_model(seed=3).float()
    rng = np.random.default_rng(1)
    trajs = asyncio.run(sample(copy.deepcopy(policy), [rng.integers(1, VOCAB, size=5).astype(np.int32)], n=4))
    st = make_actor(copy.deepcopy(policy), version=1, lr=1e-6).step(trajs)  # a lag of 1: policy, not numerics
    assert st["mismatch_tokens"] == 0 and st["mismatch_kl"] == 0.0
