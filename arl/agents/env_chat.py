"""A multi-turn agent for envs that talk in text (registered as "env-chat"): gymnasium and GEM games, reasoning-gym
questions, any env whose `reset` returns an observation and whose `step` takes the model's text.

Per prompt row: the group is reset once with the row as options (its members share seed and options, so they
start from the same observation); chain i then plays member i: generate, `step(text)`, and while the episode
goes on the next observation enters the context as a user message rendered by the chat template (loss_mask 0,
ledger source "observation"). The first user message is `instructions` + the first observation (a row without
one, e.g. math: the row's own prompt). reward = the sum of the step rewards (`reward: last` keeps the last one).

termination: "terminated" | "truncated" (the env ended it) | "max_turns" | "length" (no room for another turn
under `max_total_tokens`, or the answer was cut) | "abort". `solved`: the env said `correct`, or it terminated
with a last reward >= `success_reward`. Numbers in a step's `info["metrics"]` (e.g. the judge env's calls and
milliseconds) are summed into the trajectory's metadata, so its trace carries them.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from arl.agents.common import (agent_gconfig, check_int, encode_chat, env_for, filter_uniform, gather_or_cancel,
                               generate, new_id, row_messages)
from arl.api import (Agent, EnvironmentService, GenerateRequest, GenerationConfig, Trajectory, TrajectoryBuilder,
                     register_agent, scalar_reward)


class EnvChatAgent(Agent):
    def __init__(self, tokenizer: Any, gconfig: GenerationConfig, group_size: int = 4, max_turns: int = 4,
                 instructions: str = "", reward: str = "sum", success_reward: float = 1.0,
                 max_total_tokens: Optional[int] = None, filter_uniform_groups: bool = False) -> None:
        check_int("group_size", group_size)
        check_int("max_turns", max_turns)
        if reward not in ("sum", "last"):
            raise ValueError(f"env-chat: reward must be 'sum' or 'last', got {reward!r}")
        self.tokenizer = tokenizer
        self.group_size = group_size
        self.max_turns = max_turns
        self.instructions = instructions
        self.reward = reward
        self.success_reward = float(success_reward)
        self.max_total_tokens = max_total_tokens
        self.filter_uniform_groups = filter_uniform_groups
        self.gconfig = agent_gconfig(gconfig, tokenizer, n=1)

    def _first_messages(self, prompt: dict[str, Any], obs: Any) -> list[dict[str, str]]:
        if obs is None or (isinstance(obs, str) and not obs):
            messages = row_messages(prompt)
            if self.instructions:
                messages[-1] = {**messages[-1], "content": f"{self.instructions}{messages[-1]['content']}"}
            return messages
        return [{"role": "user", "content": f"{self.instructions}{obs}"}]

    def _no_room(self, b: TrajectoryBuilder, extra: int) -> bool:
        return self.max_total_tokens is not None and len(b) + extra + self.gconfig.max_new_tokens > self.max_total_tokens

    async def _chain(self, index: int, prompt_ids: list[int], pid: str, group_id: str, env: EnvironmentService,
                     obs_queue: asyncio.Queue, act_queue: asyncio.Queue) -> Trajectory:
        b = TrajectoryBuilder(prompt_ids)
        session = f"{group_id}/{index}"
        env = await env_for(env, index)
        rewards: list[float] = []
        errors: list[str] = []
        env_metrics: dict[str, Any] = {}  # the env's per-step `info["metrics"]` (e.g. judge calls), summed
        solved = correct_first = False
        termination = "max_turns"
        for turn in range(self.max_turns):
            if self._no_room(b, 0):
                termination = "length"
                break
            req = GenerateRequest(qid=new_id(f"{session}/t{turn}"), input_ids=b.input_ids, gconfig=self.gconfig,
                                  session_id=session)
            sample = (await generate(obs_queue, act_queue, req)).samples[0]
            b.add_generated(sample)
            text = self.tokenizer.decode(sample.output_ids.tolist(), skip_special_tokens=True)
            obs, reward, terminated, truncated, info = await env.step(text)
            rewards.append(scalar_reward(reward))
            info = info if isinstance(info, dict) else {}
            if info.get("error"):
                errors.append(str(info["error"]))
            for k, v in dict(info.get("metrics") or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    env_metrics[str(k)] = env_metrics.get(str(k), 0) + v
            correct = bool(info.get("correct", terminated and rewards[-1] >= self.success_reward))
            if turn == 0:
                correct_first = correct
            if terminated or truncated:
                solved, termination = correct, "terminated" if terminated else "truncated"
                break
            if sample.finish_reason == "abort":
                termination = "abort"
                break
            if turn == self.max_turns - 1:
                break
            obs_ids = encode_chat(self.tokenizer, [{"role": "user", "content": "" if obs is None else str(obs)}],
                                  add_generation_prompt=True)
            if self._no_room(b, len(obs_ids)):
                termination = "length"
                break
            b.add_context(obs_ids, source="observation")
        total = (sum(rewards) if self.reward == "sum" else rewards[-1]) if rewards else 0.0
        meta: dict[str, Any] = {**env_metrics, "turns": len(rewards), "first_correct": correct_first,
                                "solved": solved, "termination": termination, "prompt_id": pid,
                                "env_errors": len(errors)}  # the agent's own keys win over an env's metric
        if errors:
            meta["env_error_texts"] = errors[-3:]
        return b.build(reward=float(total), group_id=group_id, turn_rewards=rewards, metadata=meta)

    async def collect_trajectory(self, prompt: dict[str, Any], env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        pid = str(prompt.get("id", "prompt"))
        obs, _ = await env.reset(options=dict(prompt))  # every member: the same seed and options
        prompt_ids = encode_chat(self.tokenizer, self._first_messages(prompt, obs), add_generation_prompt=True)
        group_id = new_id(pid)
        trajs = await gather_or_cancel(self._chain(i, prompt_ids, pid, group_id, env, obs_queue, act_queue)
                                       for i in range(self.group_size))
        return filter_uniform(trajs, self.filter_uniform_groups)


register_agent("env-chat", EnvChatAgent)
