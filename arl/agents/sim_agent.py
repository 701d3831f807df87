"""A synthetic multi-turn tool-use agent for benchmarks (registered as "sim-agent"; pair it with "sim-tool").

Per prompt it runs `group_size` independent chats concurrently, each starting with the run's `system_tokens` and
the prompt's `prompt_tokens` (prefixes the chats share, as agents' system prompts and tasks are). A chat sends its
whole history (n=1, sticky session), appends the generated tokens, calls the tool (the env's latency), appends
the tool's tokens as context, and goes on until the env ends it or the context is full. It never decodes text, so
it runs with any engine and tokenizer:

* ``length_mode="engine"``: asks for up to ``max_new_tokens`` and lets the engine decide the length (the sim
  engine draws long-tailed lengths);
* ``length_mode="agent"``: draws a long-tailed length L itself (log-normal, ``len_median``/``len_sigma``) and
  asks for exactly L tokens (min_new_tokens = max_new_tokens = L): long-tailed lengths from a real model.

Prompt tokens, lengths and tool outputs are keyed by (seed, prompt id, chat index, turn): the same prompts make
the same workload in every run. Rewards come from the env (0/1), so groups are never uniform by construction.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any, Optional

import numpy as np

from arl.agents.common import env_for, gather_or_cancel, generate, new_id
from arl.api import (Agent, EnvironmentService, GenerateRequest, GenerationConfig, Trajectory, TrajectoryBuilder,
                     register_agent, scalar_reward)
from arl.envs.sim_tool import keyed_rng


class SimAgent(Agent):
    def __init__(self, tokenizer: Any = None, gconfig: Optional[GenerationConfig] = None, group_size: int = 8,
                 prompt_tokens: int = 256, max_new_tokens: int = 8192, max_total_tokens: int = 32768,
                 length_mode: str = "engine", len_median: float = 600.0, len_sigma: float = 1.0,
                 vocab_size: int = 0, seed: int = 0, system_tokens: int = 0) -> None:
        """`system_tokens`: a prefix every chat of the run starts with (a system prompt, tool descriptions);
        `prompt_tokens`: the prompt's own tokens after it, shared by the chats of its group."""
        if length_mode not in ("engine", "agent"):
            raise ValueError(f"length_mode must be 'engine' or 'agent', got {length_mode!r}")
        if group_size < 1 or prompt_tokens < 1 or max_new_tokens < 1 or max_total_tokens <= prompt_tokens:
            raise ValueError("need group_size, prompt_tokens, max_new_tokens >= 1 and max_total_tokens > prompt_tokens")
        self.group_size = int(group_size)
        self.prompt_tokens = int(prompt_tokens)
        self.max_new_tokens = int(max_new_tokens)
        self.max_total_tokens = int(max_total_tokens)
        self.length_mode = length_mode
        self.len_median, self.len_sigma = float(len_median), float(len_sigma)
        self.vocab_size = int(vocab_size) or (len(tokenizer) if tokenizer is not None else 32000)
        self.seed = int(seed)
        if system_tokens < 0 or system_tokens + prompt_tokens >= max_total_tokens:
            raise ValueError("need 0 <= system_tokens and system_tokens + prompt_tokens < max_total_tokens")
        self.system = self._tokens(int(system_tokens), "system")
        self.gconfig = (gconfig or GenerationConfig()).new(n=1, stop_token_ids=[])

    def _tokens(self, n: int, *key: Any) -> np.ndarray:
        return keyed_rng(self.seed, "tokens", *key).integers(0, self.vocab_size, size=n, dtype=np.int32)

    def _gconfig(self, session: str, turn: int, room: int) -> GenerationConfig:
        if self.length_mode == "engine":
            return self.gconfig.new(max_new_tokens=min(self.max_new_tokens, room), min_new_tokens=0)
        draw = keyed_rng(self.seed, "length", session, turn).lognormal(math.log(self.len_median), self.len_sigma)
        length = max(1, min(int(math.ceil(draw)), self.max_new_tokens, room))
        return self.gconfig.new(max_new_tokens=length, min_new_tokens=length)

    async def _chat(self, pid: str, index: int, env: EnvironmentService, obs_queue: asyncio.Queue,
                    act_queue: asyncio.Queue) -> Trajectory:
        session = f"{pid}/{index}"
        env = await env_for(env, index)  # its own instance: the chats run at once
        b = TrajectoryBuilder(np.concatenate([self.system, self._tokens(self.prompt_tokens, pid)]))
        reward, turn_rewards, termination, turn = 0.0, [], "length", 0
        generated = 0
        while True:
            room = self.max_total_tokens - len(b)
            if room < 1:
                break
            req = GenerateRequest(qid=new_id(f"{session}/t{turn}"), input_ids=b.input_ids,
                                  gconfig=self._gconfig(session, turn, room), session_id=session)
            sample = (await generate(obs_queue, act_queue, req)).samples[0]
            b.add_generated(sample)
            generated += len(sample.output_ids)
            if sample.finish_reason == "abort":
                termination = "abort"
                break
            obs, r, terminated, truncated, info = await env.step(
                {"session": session, "turn": turn, "n_tokens": len(sample.output_ids)})
            turn_rewards.append(scalar_reward(r))
            turn += 1
            if terminated or truncated:
                reward, termination = scalar_reward(r), ("error" if info.get("error") else "done")
                break
            b.add_context(self._tokens(int(obs), session, turn))
        return b.build(reward=reward, group_id=pid, turn_rewards=turn_rewards,
                       metadata={"turns": turn, "termination": termination, "generated": generated,
                                 "first_correct": False, "solved": reward > 0})

    async def collect_trajectory(self, prompt: dict[str, Any], env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        pid = str(prompt.get("id", prompt.get("prompt", "?")))
        return await gather_or_cancel(self._chat(pid, i, env, obs_queue, act_queue) for i in range(self.group_size))


register_agent("sim-agent", SimAgent)
