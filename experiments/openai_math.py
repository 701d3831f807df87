"""openai-math: the default a+b task, trained with an agent written against the OpenAI SDK.

    python training/main_async_ppo.py experiment=openai-math

`math_agent` below is the whole agent: the default multi-turn math agent ("Wrong, try again." after a wrong
answer, at most 3 turns, reward 0.9 ** turn) as ten lines over `openai.AsyncOpenAI`. The rollout worker runs it
against its OpenAI-compatible endpoint (docs/openai_endpoint.md), which records every turn token-exactly, so the
learner trains on exactly what the policy generated. Same model warm-up, data, learner and evaluation as the
default run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from arl.api.registry import register_agent, register_experiment
from arl.config import AgentConfig, field
from experiments.async_ppo_math import GROUP_SIZE, AsyncPPOMathConfig


async def math_agent(client: Any, prompt: dict, env: Any, num_turns: int = 2) -> dict:
    messages = [{"role": "user", "content": prompt["prompt"]}]
    for turn in range(num_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages)
        answer = reply.choices[0].message.content
        _, reward, _, _, info = await env.step(answer)
        if info.get("correct"):
            return {"reward": 0.9 ** turn, "solved": True, "first_correct": turn == 0}
        if reply.choices[0].finish_reason != "stop":  # cut by max_tokens: no retry (as the default agent)
            break
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Wrong, try again."}]
    return {"reward": 0.0, "solved": False, "first_correct": False}


register_agent("openai-math", math_agent)


@dataclasses.dataclass
class OpenAIMathConfig(AsyncPPOMathConfig):
    experiment: str = field("openai-math", "Registered experiment name.")
    agent: AgentConfig = field(factory=lambda: AgentConfig(name="openai-math", group_size=GROUP_SIZE,
                                                           args={"filter_uniform_groups": True}))


register_experiment("openai-math", OpenAIMathConfig)
