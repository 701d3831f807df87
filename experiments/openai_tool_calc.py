"""openai-tool-calc: tool-calc (arithmetic word problems, calculator and sandboxed python) written as an OpenAI SDK
agent with `tools=`; the tool loop is the user's code, the tools are arl's.

    python training/main_async_ppo.py experiment=openai-tool-calc

The endpoint renders `tools=` through the chat template, parses the model's hermes calls into `tool_calls`
(`finish_reason="tool_calls"`) while the trained ids stay the raw generated ones, and renders the `tool` messages
with the template. Same warm-up, data, budgets and learner as tool-calc; watch `rollout.tool_calls` in the train
records.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from arl.api.registry import register_agent, register_experiment
from arl.config import AgentConfig, field
from experiments.tool_calc import ToolCalcConfig

_TOOLSETS: dict[str, Any] = {}


def _tools() -> Any:
    """arl's calculator and python tools (one ToolSet per process: the python tool keeps a sandbox pool)."""
    if "tools" not in _TOOLSETS:
        from arl.tools.base import ToolSet

        _TOOLSETS["tools"] = ToolSet(["calculator", {"name": "python", "timeout": 3.0, "memory_mb": 256}])
    return _TOOLSETS["tools"]


async def tool_calc_agent(client: Any, prompt: dict, env: Any, max_turns: int = 3) -> dict:
    import openai
    from arl.tools.base import ToolCall

    tools = _tools()
    schemas = tools.schemas()
    messages = [{"role": "user", "content": prompt["prompt"]}]
    for _ in range(max_turns):
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=schemas)
        except openai.BadRequestError:  # the conversation outgrew the context
            break
        msg = reply.choices[0].message
        if not msg.tool_calls:
            if reply.choices[0].finish_reason != "stop":
                break
            _, reward, _, _, info = await env.step(msg.content or "")
            return {"reward": reward, "solved": bool(info.get("correct")), "first_correct": bool(info.get("correct"))}
        messages.append(msg.model_dump(exclude_none=True))
        for call in msg.tool_calls:
            try:
                args = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                args = {}
            result = await tools.call(ToolCall(call.function.name, args))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.content[:200]})
    return {"reward": 0.0, "solved": False, "first_correct": False}


register_agent("openai-tool-calc", tool_calc_agent)


@dataclasses.dataclass
class OpenAIToolCalcConfig(ToolCalcConfig):
    experiment: str = field("openai-tool-calc", "Registered experiment name.")
    total_train_steps: int = field(30, "Learner steps in the run.")
    agent: AgentConfig = field(factory=lambda: AgentConfig(name="openai-tool-calc", group_size=8,
                                                           args={"filter_uniform_groups": True}))


register_experiment("openai-tool-calc", OpenAIToolCalcConfig)
