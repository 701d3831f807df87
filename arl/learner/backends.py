"""Learner backends by name (``learner.backend``): how to build the training engine, and what it can do.

Why a registry: the launcher builds any backend the same way, with no branch per name; a backend's entry says
whether it trains a real model (then the run checkpoints and resumes, checks token ids against the vocabulary and
may use several ranks) or only models the time (the simulated one). Builders import torch / DeepSpeed lazily, so
the launcher can read the table without them. The table is `arl.api.registry.LEARNER_BACKENDS` (config checks
`learner.backend` against it without importing this module).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from arl.api.engine import TrainEngine
from arl.api.registry import LEARNER_BACKENDS

__all__ = ["LearnerBackend", "LEARNER_BACKENDS", "register_learner_backend"]


@dataclasses.dataclass(frozen=True)
class LearnerBackend:
    build: Callable[[Any], TrainEngine]  # (ExperimentConfig) -> this rank's engine
    trains_model: bool  # checkpoints, resume, vocabulary checks, several ranks


def register_learner_backend(name: str, backend: LearnerBackend) -> LearnerBackend:
    return LEARNER_BACKENDS.register(name, backend)


def _deepspeed(cfg: Any) -> TrainEngine:
    from arl.learner.deepspeed_engine import DeepSpeedEngine
    from arl.models.tiny import load_model_dir

    lc = cfg.learner
    model, _ = load_model_dir(cfg.model.path)
    return DeepSpeedEngine(model, lc.optimizer, lc.deepspeed, seed=cfg.seed, reference=bool(lc.ppo.kl_coef),
                           total_optimizer_steps=cfg.total_train_steps * lc.ppo.minibatches,  # steps, not batches
                           device=str(lc.device), lora=lc.lora)


def _sim(cfg: Any) -> TrainEngine:
    from arl.learner.sim_learner import SimLearner

    return SimLearner(cfg.learner.sim)


# the built-ins, bound by name in `arl.api.registry.LEARNER_BACKENDS` (config validation reads the names there)
DEEPSPEED = LearnerBackend(_deepspeed, trains_model=True)
SIM = LearnerBackend(_sim, trains_model=False)
