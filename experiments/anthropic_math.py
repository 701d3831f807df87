"""anthropic-math: the default a+b task, trained with an agent written against Anthropic's Python SDK.

    python training/main_async_ppo.py experiment=anthropic-math

`math_agent` below is the whole agent: the default multi-turn math agent ("Wrong, try again." after a wrong
answer, at most 3 turns, reward 0.9 ** turn) over `anthropic.AsyncAnthropic`'s Messages API. The rollout worker
hands it a client of its endpoint's `/v1/messages` (in process: no socket), which records every turn
token-exactly, so the learner trains on exactly what the policy generated. Same warm-up, data, learner and
evaluation as the default run and `experiment=openai-math`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from arl.api.registry import register_agent, register_experiment
from arl.config import AgentConfig, field
from experiments.async_ppo_math import GROUP_SIZE, AsyncPPOMathConfig


async def math_agent(anthropic: Any, prompt: dict, env: Any, num_turns: int = 2, max_tokens: int = 8) -> dict:
    # max_tokens: required by the Messages API; 8 is the default run's gen.max_new_tokens
    messages = [{"role": "user", "content": prompt["prompt"]}]
    for turn in range(num_turns):
        reply = await anthropic.messages.create(model="policy", max_tokens=max_tokens, messages=messages)
        answer = reply.content[0].text
        _, reward, _, _, info = await env.step(answer)
        if info.get("correct"):
            return {"reward": 0.9 ** turn, "solved": True, "first_correct": turn == 0}
        if reply.stop_reason != "end_turn":  # cut by max_tokens: no retry (as the default agent)
            break
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Wrong, try again."}]
    return {"reward": 0.0, "solved": False, "first_correct": False}


register_agent("anthropic-math", math_agent)


@dataclasses.dataclass
class AnthropicMathConfig(AsyncPPOMathConfig):
    experiment: str = field("anthropic-math", "Registered experiment name.")
    agent: AgentConfig = field(factory=lambda: AgentConfig(name="anthropic-math", group_size=GROUP_SIZE,
                                                           args={"filter_uniform_groups": True}))


register_experiment("anthropic-math", AnthropicMathConfig)
