"""tool-calc: the tiny model learns to solve arithmetic word problems with a calculator (and a sandboxed python
tool), on CPU, in minutes.

    python training/main_async_ppo.py experiment=tool-calc

The warm-up (`arl.recipes.warmup_tools`) teaches the hermes call format on a mix of tool and direct answers;
RL then moves the policy toward the calculator, because two-digit sums and products answered "in the head" are
mostly wrong. Watch `rollout.tool_calls` / `rollout.reward` in the train records and `traj_means.tool_calls` /
`first_acc` in the eval records of metrics.jsonl.
"""

from __future__ import annotations

import dataclasses

from arl.api.registry import register_experiment
from arl.config import (
    AgentConfig,
    DatasetConfig,
    EvalConfig,
    ExperimentConfig,
    GenerationArgs,
    InferenceConfig,
    LearnerConfig,
    ModelConfig,
    OptimizerConfig,
    RolloutConfig,
    field,
)

TOOL_AGENT_ARGS = {
    "tools": ["calculator", "python"],
    "tool_kwargs": {"python": {"timeout": 3.0, "memory_mb": 256}},
    "max_turns": 3,
    "max_total_tokens": 320,
    "max_observation_tokens": 48,
    "answer_regex": r"\d",
}


@dataclasses.dataclass
class ToolCalcConfig(ExperimentConfig):
    experiment: str = field("tool-calc", "Registered experiment name.")
    total_train_steps: int = field(60, "Learner steps in the run.")
    model: ModelConfig = field(factory=lambda: ModelConfig(warmup="arl.recipes.warmup_tools:get_warm_tool_model",
                                                           warmup_target_acc=0.3, warmup_max_steps=1500))
    dataset: DatasetConfig = field(factory=lambda: DatasetConfig(name="word-arith", test_size=200))
    gen: GenerationArgs = field(factory=lambda: GenerationArgs(max_new_tokens=96, temperature=1.0))
    agent: AgentConfig = field(factory=lambda: AgentConfig(name="tool-agent", group_size=8,
                                                           args=dict(TOOL_AGENT_ARGS)))
    inference: InferenceConfig = field(factory=lambda: InferenceConfig(max_context_len=384))
    rollout: RolloutConfig = field(factory=lambda: RolloutConfig(max_concurrent_rollouts=16, filter_void_turns=True,
                                                                 filter_uniform_groups=True,
                                                                 verify_token_ledger=True))
    learner: LearnerConfig = field(factory=lambda: LearnerConfig(batch_size=8, optimizer=OptimizerConfig(lr=1e-4)))
    eval: EvalConfig = field(factory=lambda: EvalConfig(every_n_steps=10, max_prompts=100))


register_experiment("tool-calc", ToolCalcConfig)
