"""Imports the library's built-in agents and environments so their register_* calls run, and registers the
adapters to other environment libraries by where they live (imported only when a run chooses one: their
packages are the optional extra `arl[envs]`).

The built-in experiments live outside the library (`experiments/`): the entry point passes their modules to
`arl.cli.main`, which records the chosen experiment's module in `imports` so every role process imports it too.
"""

from __future__ import annotations

import importlib

BUILTIN_MODULES = (
    "arl.agents.math_single_step",
    "arl.agents.math_multi_turn",
    "arl.agents.tool_agent",
    "arl.agents.env_chat",
    "arl.agents.self_play",
    "arl.agents.proposer_solver",
    "arl.envs.math",
    "arl.envs.nim",
)

LAZY_ENVS = {  # env name -> "module:class"
    "gymnasium": "arl.envs.gymnasium_env:GymnasiumEnv",
    "gem": "arl.envs.gem_env:GemEnv",
    "reasoning-gym": "arl.envs.reasoning_gym_env:ReasoningGymEnv",
    "judge": "arl.envs.judge:JudgeEnv",
}

LAZY_AGENTS = {  # agent name -> "module:attribute"
    "verifiers": "arl.envs.verifiers_env:verifiers_agent",
    "external": "arl.rollout.external_agent:ExternalAgent",  # agents outside the run, through the task API
}


def load_builtins() -> None:
    from arl.api.registry import AGENTS, ENVS

    for m in BUILTIN_MODULES:
        importlib.import_module(m)
    for name, target in LAZY_ENVS.items():
        if name not in ENVS:
            ENVS.register_lazy(name, target)
    for name, target in LAZY_AGENTS.items():
        if name not in AGENTS:
            AGENTS.register_lazy(name, target)
