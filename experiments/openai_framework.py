"""openai-framework and responses-framework: an agent written with a third-party framework, the OpenAI Agents SDK
(`openai-agents`, in the `agents` extra: `pip install -e '.[agents]'`), trained unmodified apart from the client
it is given.

    python training/main_async_ppo.py experiment=openai-framework       # its chat completions model class
    python training/main_async_ppo.py experiment=responses-framework    # its default model: the Responses API

The task is tool-calc's (arithmetic word problems, the tiny tool model's warm-up): an `agents.Agent` with one
`@function_tool` calculator, run by `Runner.run`. Why the Agents SDK over LangGraph + langchain-openai (both were
tried against the endpoint with the tiny model and both continue token-exactly): it takes the session's
`AsyncOpenAI` as it is (`OpenAIChatCompletionsModel(openai_client=client)`), so it shares the rollout worker's
connection pool instead of building an HTTP client per session, and it adds no system message when it has no
instructions, so the prompt is the one the warm-up taught. With `api="responses"` the agent runs on the SDK's
default model provider (`OpenAIProvider`, whose default is the Responses API) over the session's client; the
endpoint serves `/v1/responses` token-exactly, function calls and their outputs included. Tracing is disabled (it
would export to OpenAI).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from arl.api.registry import register_agent, register_experiment
from arl.config import AgentConfig, field
from experiments.openai_tool_calc import _tools
from experiments.tool_calc import ToolCalcConfig


async def framework_agent(client: Any, prompt: dict, env: Any, max_turns: int = 3, api: str = "chat") -> dict:
    from agents import Agent, AgentsException, OpenAIChatCompletionsModel, OpenAIProvider, RunConfig, Runner
    from agents import function_tool, set_tracing_disabled

    from arl.tools.base import ToolCall

    set_tracing_disabled(True)
    tools = _tools()  # arl's calculator and sandboxed python, as in tool-calc

    @function_tool
    async def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression."""
        return (await tools.call(ToolCall("calculator", {"expression": expression}))).content

    @function_tool
    async def python(code: str) -> str:
        """Run Python code and return what it prints."""
        return (await tools.call(ToolCall("python", {"code": code}))).content

    if api == "responses":  # the SDK's default model class, from its default provider, on the session's client
        agent = Agent(name="calc", tools=[calculator, python], model="policy")
        run_config = RunConfig(model_provider=OpenAIProvider(openai_client=client))
    else:
        agent = Agent(name="calc", tools=[calculator, python],
                      model=OpenAIChatCompletionsModel("policy", openai_client=client))
        run_config = RunConfig()
    try:
        result = await Runner.run(agent, prompt["prompt"], max_turns=max_turns, run_config=run_config)
    except AgentsException:  # out of turns, or a call the SDK refused (an unknown tool, bad arguments)
        return {"reward": 0.0, "solved": False, "first_correct": False}
    _, reward, _, _, info = await env.step(str(result.final_output))
    return {"reward": reward, "solved": bool(info.get("correct")), "first_correct": bool(info.get("correct"))}


register_agent("openai-framework", framework_agent)


@dataclasses.dataclass
class OpenAIFrameworkConfig(ToolCalcConfig):
    experiment: str = field("openai-framework", "Registered experiment name.")
    total_train_steps: int = field(20, "Learner steps in the run.")
    agent: AgentConfig = field(factory=lambda: AgentConfig(name="openai-framework", group_size=8,
                                                           args={"filter_uniform_groups": True}))


register_experiment("openai-framework", OpenAIFrameworkConfig)


@dataclasses.dataclass
class ResponsesFrameworkConfig(OpenAIFrameworkConfig):
    experiment: str = field("responses-framework", "Registered experiment name.")
    agent: AgentConfig = field(factory=lambda: AgentConfig(name="openai-framework", group_size=8,
                                                           args={"filter_uniform_groups": True, "api": "responses"}))


register_experiment("responses-framework", ResponsesFrameworkConfig)
