"""Single-step math agent: one request with n=group_size samples, one reward per sample.

Prompt row: {"id", "prompt" (or "messages"), "answer"}. Each sample becomes a Trajectory
`prompt ids (loss_mask 0) + generated ids as returned by the engine (loss_mask 1)`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from arl.agents.common import env_for, generate, new_id, start_prompt
from arl.api import (
    Agent,
    EnvironmentService,
    GenerateRequest,
    GenerationConfig,
    Trajectory,
    TrajectoryBuilder,
    register_agent,
    scalar_reward,
)


def _with_eos_stop(gconfig: GenerationConfig, eos_token_id: Any) -> GenerationConfig:
    stops = list(gconfig.stop_token_ids)
    if eos_token_id is not None and int(eos_token_id) not in stops:
        stops.append(int(eos_token_id))
    return gconfig.new(stop_token_ids=stops)


def is_uniform(rewards: list[float]) -> bool:
    return len(rewards) > 1 and all(r == rewards[0] for r in rewards)


class MathSingleStepAgent(Agent):
    """`filter_uniform_groups`: return [] when every sample got the same reward (no group-relative signal);
    a group of one trajectory (evaluation) is never filtered."""

    def __init__(self, tokenizer: Any, gconfig: GenerationConfig, group_size: int = 8,
                 filter_uniform_groups: bool = True) -> None:
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.gconfig = _with_eos_stop(gconfig.new(n=group_size), tokenizer.eos_token_id)
        self.gconfig.validate()
        self.filter_uniform_groups = filter_uniform_groups

    async def collect_trajectory(
        self,
        prompt: dict[str, Any],
        env: EnvironmentService,
        obs_queue: asyncio.Queue,
        act_queue: asyncio.Queue,
    ) -> list[Trajectory]:
        pid, group_id, prompt_ids = await start_prompt(self.tokenizer, prompt, env)
        req = GenerateRequest(qid=new_id(pid), input_ids=prompt_ids, gconfig=self.gconfig)
        resp = await generate(obs_queue, act_queue, req)

        texts = [self.tokenizer.decode(s.output_ids.tolist(), skip_special_tokens=True) for s in resp.samples]
        envs = [await env_for(env, i) for i in range(len(texts))]  # one env per trajectory in an env group
        steps = await asyncio.gather(*(e.step(t) for e, t in zip(envs, texts)))

        trajs = []
        for sample, (_, reward, _, _, info) in zip(resp.samples, steps):
            b = TrajectoryBuilder(prompt_ids)
            b.add_generated(sample)
            correct = bool(info.get("correct", False))
            meta = {"turns": 1, "first_correct": correct, "solved": correct, "termination": sample.finish_reason,
                    "prompt_id": pid}
            if info.get("error"):
                meta["reward_error"] = info["error"]
            r = scalar_reward(reward)
            trajs.append(b.build(reward=r, group_id=group_id, turn_rewards=[r], metadata=meta))
        if self.filter_uniform_groups and is_uniform([t.reward for t in trajs]):
            return []
        return trajs


register_agent("math-single-step", MathSingleStepAgent)
