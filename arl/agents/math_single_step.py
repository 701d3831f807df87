"""Single-step math agent: one request with n=group_size samples, one reward per sample.

Prompt row: {"id", "prompt" (or "messages"), "answer"}. Each sample becomes a Trajectory
`prompt ids (loss_mask 0) + generated ids as returned by the engine (loss_mask 1)`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from arl.agents.common import agent_gconfig, check_int, env_for, filter_uniform, generate, new_id, start_prompt
from arl.api import (Agent, EnvironmentService, GenerateRequest, GenerationConfig, Trajectory, TrajectoryBuilder,
                     register_agent, scalar_reward)


class MathSingleStepAgent(Agent):
    """`filter_uniform_groups`: return [] when every sample got the same reward (no group-relative signal);
    a group of one trajectory (evaluation) is never filtered."""

    def __init__(self, tokenizer: Any, gconfig: GenerationConfig, group_size: int = 8,
                 filter_uniform_groups: bool = True) -> None:
        check_int("group_size", group_size)
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.gconfig = agent_gconfig(gconfig, tokenizer, n=group_size)
        self.filter_uniform_groups = filter_uniform_groups

    async def collect_trajectory(self, prompt: dict[str, Any], env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
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
        return filter_uniform(trajs, self.filter_uniform_groups)


register_agent("math-single-step", MathSingleStepAgent)
