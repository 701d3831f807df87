"""gsm8k: a real instruct model on GSM8K-style jsonl with math-verify rewards and the tool agent (config only:
for GPU users; nothing here is downloaded).

    python training/main_async_ppo.py experiment=gsm8k model.path=/models/Qwen2.5-1.5B-Instruct \\
        dataset.train_path=data/gsm8k_train.jsonl dataset.test_path=data/gsm8k_test.jsonl

jsonl rows: {"id", "prompt", "answer"} (the answer may be the full GSM8K solution: "#### 72" is read); a
HuggingFace `save_to_disk` folder or parquet file works with dataset.name=hf. `arl/data/samples/` has a few
rows in both formats for a smoke test. The model calls the calculator / sandboxed python tools in hermes format
(Qwen2.5 chat templates render the tool schemas into the system prompt) and ends with \\boxed{answer}.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from arl.api.registry import register_experiment
from arl.config import (
    AgentConfig,
    DatasetConfig,
    DeepSpeedConfig,
    EnvConfig,
    EvalConfig,
    ExperimentConfig,
    GenerationArgs,
    InferenceConfig,
    LearnerConfig,
    OptimizerConfig,
    RolloutConfig,
    field,
)

SYSTEM_PROMPT = ("Solve the math problem. You may call the calculator or python tools. "
                 "Put the final answer in \\boxed{}.")


def gsm8k_tool_demo(**kwargs: Any) -> Any:
    """The tool conversation the tiny Qwen2 model is taught for this experiment's prompts (its SYSTEM_PROMPT;
    `arl.recipes.tool_demo.tool_demo` takes the other arguments). Imported lazily: torch is not needed to register
    the experiment."""
    from arl.recipes.tool_demo import tool_demo

    return tool_demo(SYSTEM_PROMPT, **kwargs)


@dataclasses.dataclass
class GSM8KConfig(ExperimentConfig):
    experiment: str = field("gsm8k", "Registered experiment name.")
    total_train_steps: int = field(200, "Learner steps in the run.")
    dataset: DatasetConfig = field(factory=lambda: DatasetConfig(name="jsonl",
                                                                 train_path="arl/data/samples/gsm8k_sample.jsonl",
                                                                 test_path="arl/data/samples/gsm8k_sample.jsonl"))
    gen: GenerationArgs = field(factory=lambda: GenerationArgs(max_new_tokens=1024, temperature=1.0))
    agent: AgentConfig = field(factory=lambda: AgentConfig(name="tool-agent", group_size=8, args={
        "tools": ["calculator", "python"],
        "tool_kwargs": {"python": {"timeout": 10.0, "memory_mb": 1024}},
        "max_turns": 6,
        "max_total_tokens": 6144,
        "max_observation_tokens": 512,
        "max_total_observation_tokens": 2048,
        "answer_regex": r"\\boxed|\d",
        "system_prompt": SYSTEM_PROMPT,
    }))
    env: EnvConfig = field(factory=lambda: EnvConfig(name="math", args={
        "reward_fn": "arl.envs.math_verify:math_verify_reward", "timeout": 120.0}))
    inference: InferenceConfig = field(factory=lambda: InferenceConfig(backend="sglang", max_context_len=8192,
                                                                       device="cuda"))
    rollout: RolloutConfig = field(factory=lambda: RolloutConfig(max_concurrent_rollouts=128,
                                                                 trajectory_timeout=900.0, filter_void_turns=True,
                                                                 filter_uniform_groups=True,
                                                                 verify_token_ledger=True))
    learner: LearnerConfig = field(factory=lambda: LearnerConfig(
        batch_size=32, optimizer=OptimizerConfig(lr=1e-6),
        deepspeed=DeepSpeedConfig(bf16=True, zero_stage=2, max_tokens_per_mb=16384)))
    eval: EvalConfig = field(factory=lambda: EvalConfig(every_n_steps=20, max_prompts=500))


register_experiment("gsm8k", GSM8KConfig)
