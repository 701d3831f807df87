"""self-play: the tiny model learns Nim by playing itself, measured against a frozen copy of where it started, on
CPU, in minutes.

    python training/main_async_ppo.py experiment=self-play

One pile of 5..20 stones, each player takes 1..3, whoever takes the last stone wins (`arl.envs.nim`). The warm-up
(`arl.recipes.warmup_nim`) makes the model a random legal player; RL then plays it against itself
(`arl.agents.self_play`: both seats are the run's policy, the winner's moves get +0.5 advantage, the loser's
-0.5). The run trains LoRA adapters, so the base model is the policy as it started: it is served beside the
run's policy as the frozen policy `start` (`policies: [{name: start, adapter: base}]`), and every evaluation
plays each of the 16 piles twice against it, once moving first and once second. The eval record's `first_acc`
is the win rate against the frozen start: 0.5 at step 0 (the same player on both sides), higher as the policy
finds the winning rule (take pile % 4 when that is not 0). Requires peft (pip install 'arl[lora]').
"""

from __future__ import annotations

import dataclasses

from arl.api.registry import register_experiment
from arl.config import (
    AgentConfig,
    DatasetConfig,
    EnvConfig,
    EvalConfig,
    ExperimentConfig,
    GenerationArgs,
    LearnerConfig,
    LoraConfig,
    LRSchedule,
    ModelConfig,
    OptimizerConfig,
    PolicyConfig,
    RolloutConfig,
    field,
)

PILES = {"min_pile": 5, "max_pile": 20, "max_take": 3}


def _learner() -> LearnerConfig:
    return LearnerConfig(
        batch_size=8, optimizer=OptimizerConfig(lr=2e-4, lr_schedule=LRSchedule.linear, min_lr_ratio=0.0),
        lora=LoraConfig(rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"]))


def _model() -> ModelConfig:
    return ModelConfig(warmup="arl.recipes.warmup_nim:get_warm_nim_model", warmup_target_acc=0.97,
                       warmup_max_steps=300)


def _dataset() -> DatasetConfig:  # env-seeds rows: the env makes the pile from the seed; 32 held-out seeds = 16
    return DatasetConfig(name="env-seeds", train_size=4096, test_size=32)  # piles x who moves first


def _env() -> EnvConfig:
    return EnvConfig(name="nim", args=dict(PILES))


def _gen() -> GenerationArgs:
    return GenerationArgs(max_new_tokens=3, temperature=1.0)


def _rollout() -> RolloutConfig:
    return RolloutConfig(max_concurrent_rollouts=16, verify_token_ledger=True)


def _eval() -> EvalConfig:  # all 32 held-out seeds
    return EvalConfig(every_n_steps=20, max_prompts=0)


@dataclasses.dataclass
class SelfPlayConfig(ExperimentConfig):
    experiment: str = field("self-play", "Registered experiment name.")
    total_train_steps: int = field(300, "Learner steps in the run.")
    model: ModelConfig = field(factory=_model)
    dataset: DatasetConfig = field(factory=_dataset)
    env: EnvConfig = field(factory=_env)
    gen: GenerationArgs = field(factory=_gen)
    agent: AgentConfig = field(factory=lambda: AgentConfig(name="self-play", group_size=8,
                                                           args={"eval_opponent": "start"}))
    rollout: RolloutConfig = field(factory=_rollout)
    learner: LearnerConfig = field(factory=_learner)
    policies: list[PolicyConfig] = field(factory=lambda: [PolicyConfig(name="start", adapter="base")],
                                         help="The frozen start, the evaluation's opponent.")
    eval: EvalConfig = field(factory=_eval)


@dataclasses.dataclass
class SelfPlayRivalsConfig(ExperimentConfig):
    """Two policies trained separately in one run: the run's own and `rival` (a trainable listed policy with a
    learner of its own, `learner1`), playing each other; each learner trains its own seat's moves. Evaluation: the
    run's policy against the frozen start, as in `self-play`.

        python training/main_async_ppo.py experiment=self-play-rivals
    """

    experiment: str = field("self-play-rivals", "Registered experiment name.")
    total_train_steps: int = field(300, "Learner steps in the run (each policy's learner).")
    model: ModelConfig = field(factory=_model)
    dataset: DatasetConfig = field(factory=_dataset)
    env: EnvConfig = field(factory=_env)
    gen: GenerationArgs = field(factory=_gen)
    agent: AgentConfig = field(factory=lambda: AgentConfig(name="self-play", group_size=8, args={
        "opponent": "rival", "train_opponent": True, "eval_opponent": "start"}))
    rollout: RolloutConfig = field(factory=_rollout)
    learner: LearnerConfig = field(factory=_learner)
    policies: list[PolicyConfig] = field(factory=lambda: [PolicyConfig(name="start", adapter="base"),
                                                          PolicyConfig(name="rival", adapter="base", trainable=True)],
                                         help="The frozen start (the evaluation's opponent) and the rival, trained.")
    eval: EvalConfig = field(factory=_eval)


register_experiment("self-play", SelfPlayConfig)
register_experiment("self-play-rivals", SelfPlayRivalsConfig)
