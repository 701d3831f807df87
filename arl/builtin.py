"""Imports the built-in agents, environments and experiments so their register_* calls run."""

from __future__ import annotations

import importlib

BUILTIN_MODULES = (
    "arl.agents.math_single_step",
    "arl.agents.math_multi_turn",
    "arl.agents.tool_agent",
    "arl.envs.math",
    "experiments.async_ppo_math",
    "experiments.tool_calc",
    "experiments.gsm8k",
)


def load_builtins() -> None:
    for m in BUILTIN_MODULES:
        importlib.import_module(m)
