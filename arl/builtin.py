"""Imports the library's built-in agents and environments so their register_* calls run.

The built-in experiments live outside the library (`experiments/`): the entry point passes their modules to
`arl.cli.main`, which records the chosen experiment's module in `imports` so every role process imports it too.
"""

from __future__ import annotations

import importlib

BUILTIN_MODULES = (
    "arl.agents.math_single_step",
    "arl.agents.math_multi_turn",
    "arl.agents.tool_agent",
    "arl.envs.math",
)


def load_builtins() -> None:
    for m in BUILTIN_MODULES:
        importlib.import_module(m)
