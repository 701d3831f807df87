"""Build a `PPOActor` on a `DeepSpeedEngine` from flat keyword arguments (each goes to the config section that
has a field of its name), so tests can say ``make_actor(model, lr=1e-3, loss_agg="seq")``."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from arl.config import DeepSpeedConfig, LoraConfig, OptimizerConfig, PPOConfig
from arl.api.staleness import StalenessPolicy


def make_actor(model: torch.nn.Module, *, version: int = 0, seed: int = 0, temperature: float = 1.0,
               eta: Optional[int] = None, total_steps: int = 1, **kw: Any) -> Any:
    from arl.learner.actor import PPOActor
    from arl.learner.deepspeed_engine import DeepSpeedEngine

    # One optimizer step per batch unless a test asks for more: most tests compare a step with a hand computation
    # (the default of several minibatches is tested in test_ppo_minibatches.py and by every end-to-end run).
    kw.setdefault("minibatches", 1)
    sections: dict[type, dict[str, Any]] = {OptimizerConfig: {}, DeepSpeedConfig: {}, PPOConfig: {}, LoraConfig: {}}
    for k, v in kw.items():
        owner = [c for c in sections if k in {f.name for f in dataclasses.fields(c)}]
        if not owner:
            raise TypeError(f"no config section has a field {k!r}")
        sections[owner[0]][k] = v
    ppo = PPOConfig(**sections[PPOConfig])
    engine = DeepSpeedEngine(model, OptimizerConfig(**sections[OptimizerConfig]),
                             DeepSpeedConfig(**sections[DeepSpeedConfig]), seed=seed, version=version,
                             total_optimizer_steps=total_steps, reference=bool(ppo.kl_coef),
                             lora=LoraConfig(**sections[LoraConfig]))
    return PPOActor(engine, ppo, temperature=temperature,
                    staleness=StalenessPolicy(eta, ppo.stale_tokens, ppo.stale_token_decay))
