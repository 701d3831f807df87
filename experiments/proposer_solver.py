"""proposer-solver: the tiny model writes its own a+b problems and learns to solve them, on CPU, in minutes.

    python training/main_async_ppo.py experiment=proposer-solver

One policy plays both roles (`arl.agents.proposer_solver`): as the proposer it writes problems (`propose` ->
`12+30=`) and is rewarded for those it solves about half the time; as the solver it answers each problem 4 times
and is rewarded for right answers. No dataset problem is trained on: the training rows only pace the groups, the
proposer writes every problem (never one of the held-out split). The evaluation is the solver alone, greedy, on the
held-out a+b split: `first_acc` in the eval records, comparable with the default run's.
"""

from __future__ import annotations

import dataclasses

from arl.api.registry import register_experiment
from arl.config import (
    AgentConfig,
    EvalConfig,
    ExperimentConfig,
    LearnerConfig,
    LoraConfig,
    LRSchedule,
    ModelConfig,
    OptimizerConfig,
    PolicyConfig,
    RolloutConfig,
    field,
)


def _model() -> ModelConfig:
    return ModelConfig(warmup="arl.recipes.warmup_proposer:get_warm_proposer_model")


def _rollout() -> RolloutConfig:
    return RolloutConfig(max_concurrent_rollouts=16, verify_token_ledger=True)


def _eval() -> EvalConfig:
    return EvalConfig(every_n_steps=20, max_prompts=200)


@dataclasses.dataclass
class ProposerSolverConfig(ExperimentConfig):
    experiment: str = field("proposer-solver", "Registered experiment name.")
    total_train_steps: int = field(300, "Learner steps in the run.")
    model: ModelConfig = field(factory=_model)
    agent: AgentConfig = field(factory=lambda: AgentConfig(
        name="proposer-solver", group_size=8, args={"solver_attempts": 4, "max_operand": 49}))
    rollout: RolloutConfig = field(factory=_rollout)
    learner: LearnerConfig = field(factory=lambda: LearnerConfig(
        batch_size=4, optimizer=OptimizerConfig(lr_schedule=LRSchedule.linear, min_lr_ratio=0.0)))
    eval: EvalConfig = field(factory=_eval)


@dataclasses.dataclass
class ProposerSolverTwoConfig(ExperimentConfig):
    """The proposer and the solver as two policies, each trained by a learner of its own: the run's policy solves,
    `proposer` (a trainable listed policy, learner1) writes the problems. Both are LoRA adapters on the warmed-up
    base (a trainable listed policy is an adapter beside the run's), so the run trains LoRA too.

        pip install -e '.[lora]' && python training/main_async_ppo.py experiment=proposer-solver-two
    """

    experiment: str = field("proposer-solver-two", "Registered experiment name.")
    total_train_steps: int = field(300, "Learner steps in the run (each policy's learner).")
    model: ModelConfig = field(factory=_model)
    agent: AgentConfig = field(factory=lambda: AgentConfig(
        name="proposer-solver", group_size=8, args={"solver_attempts": 4, "max_operand": 49, "proposer": "proposer"}))
    rollout: RolloutConfig = field(factory=_rollout)
    learner: LearnerConfig = field(factory=lambda: LearnerConfig(
        batch_size=4, optimizer=OptimizerConfig(lr_schedule=LRSchedule.linear, min_lr_ratio=0.0),
        lora=LoraConfig(rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"])))
    policies: list[PolicyConfig] = field(factory=lambda: [PolicyConfig(name="proposer", adapter="base",
                                                                       trainable=True)],
                                         help="The proposer, trained by its own learner.")
    eval: EvalConfig = field(factory=_eval)


register_experiment("proposer-solver", ProposerSolverConfig)
register_experiment("proposer-solver-two", ProposerSolverTwoConfig)
