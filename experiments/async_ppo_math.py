"""The default experiment: async PPO with the multi-turn math agent on the built-in a+b task, tiny model, CPU."""

from __future__ import annotations

import dataclasses

from arl.api.registry import register_experiment
from arl.config import ExperimentConfig


@dataclasses.dataclass
class AsyncPPOMathConfig(ExperimentConfig):
    """Defaults are the ones in arl.config; this class is where a variant would override them."""


register_experiment("async-ppo-math", AsyncPPOMathConfig)
