"""The built-in experiments; the entry point (training/main_async_ppo.py) passes MODULES to `arl.cli.main`."""

MODULES = ("experiments.async_ppo_math", "experiments.tool_calc", "experiments.gsm8k", "experiments.openai_math",
           "experiments.openai_tool_calc", "experiments.openai_framework", "experiments.anthropic_math",
           "experiments.self_play", "experiments.proposer_solver")
