"""Agents written against the OpenAI or Anthropic API: a plain async function registered with
`register_agent(name, fn)`,

    async def run(client: openai.AsyncOpenAI, prompt: dict, env) -> float | dict | None

(or `anthropic: anthropic.AsyncAnthropic` for the Messages API; or `base_url` / `api_key` instead of a client, for
code that builds its own client or runs a subprocess with OPENAI_BASE_URL / OPENAI_API_KEY: `base_url` ends in
`/v1`, the Anthropic SDK takes it without; the key is the session's own token, never the run's secret), is run by
`EndpointAgent`: one session of the rollout worker's endpoint
(`arl.rollout.endpoint`) per trajectory, `group_size` sessions per prompt forming the group. The reward is the
function's return value: a number, or a dict with "reward" (its other keys become trajectory metadata); None
takes it from `env.step(<the last answer's text>)`. Every generated token is recorded by the session
(`arl.rollout.sessions`), so the trajectories are the engine's tokens exactly.

A function that raises, overruns the trajectory deadline, or calls its session after it ended drops its group
(the rollout worker counts the reason). `openai` is imported only when such an agent runs.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Callable, Optional

from arl.agents.common import env_for, filter_uniform, gather_or_cancel, new_id, queue_client
from arl.api.agent import Agent, EnvironmentService
from arl.api.types import Trajectory, scalar_reward
from arl.rollout.endpoint import EndpointServer, SessionHandle
from arl.rollout.worker import plain

__all__ = ["EndpointAgent", "SessionCallAfterEnd", "is_endpoint_agent", "session_trajectories"]


class SessionCallAfterEnd(RuntimeError):
    """The agent function called its session after it had returned (a leaked task): its group is dropped."""


def is_endpoint_agent(obj: Any) -> bool:
    """A registered agent that is an async function (not an `Agent` class): it talks to the endpoint."""
    return inspect.iscoroutinefunction(obj)


async def session_trajectories(server: EndpointServer, h: SessionHandle, env: Any, result: Any, pid: str,
                               group_id: str, who: str) -> list[Trajectory]:
    """The trajectories of one ended session, with its reward: `result` a number, a dict with "reward" (its other
    keys become metadata), or None (the env scores the last answer's text). `who` names the agent in errors."""
    s = h.session
    if not s.turns:
        return []
    metadata: dict[str, Any] = {"prompt_id": pid}
    if result is None:  # the reward is the env's, for the last answer
        last = s.turns[-1].choices[0].sample.output_ids.tolist()
        _, reward, _, _, info = await env.step(server.tokenizer.decode(last, skip_special_tokens=True))
        reward = scalar_reward(reward)
        metadata["solved"] = bool((info or {}).get("correct", reward > 0))
    elif isinstance(result, dict):
        if "reward" not in result:
            raise ValueError(f"{who} returned a dict without 'reward'")
        reward = scalar_reward(result["reward"])
        metadata.update(plain({k: v for k, v in result.items() if k != "reward"}))
    else:
        reward = scalar_reward(result)
    trajs = s.trajectories(reward, group_id, metadata)
    for t in trajs:
        t.metadata.setdefault("solved", reward > 0)
        t.metadata.setdefault("first_correct", bool(t.metadata["solved"]) and s.mismatches == 0
                              and len(s.turns) == 1)
    return trajs


class EndpointAgent(Agent):
    """Runs an OpenAI-API agent function `group_size` times per prompt, each in its own endpoint session.

    Args:
        fn: the agent function; it gets the names it asks for among client, base_url, api_key, prompt, env, and
            those of `args` its signature takes.
        server: the worker's endpoint (started on first use).
        group_size: sessions (trajectories, unless a session branches) per prompt.
        greedy: evaluation: every request of these sessions is decoded greedily.
        filter_uniform_groups: drop a group whose rewards are all equal.
    """

    def __init__(self, fn: Callable[..., Any], server: EndpointServer, group_size: int = 1, greedy: bool = False,
                 filter_uniform_groups: bool = False, args: Optional[dict[str, Any]] = None) -> None:
        if not is_endpoint_agent(fn):
            raise TypeError(f"an endpoint agent must be an async function, got {type(fn).__name__}")
        self.fn, self.server = fn, server
        self.group_size, self.greedy = int(group_size), greedy
        self.filter_uniform_groups = filter_uniform_groups
        params = inspect.signature(fn).parameters
        self._takes_all = any(p.kind == p.VAR_KEYWORD for p in params.values())
        self._params = set(params)
        unknown = [k for k in (args or {}) if k not in params and not self._takes_all]
        if unknown:
            raise TypeError(f"agent.args {unknown} are not parameters of {fn.__name__}{inspect.signature(fn)}")
        self.args = dict(args or {})

    def _wants(self, name: str) -> bool:
        return name in self._params or self._takes_all

    async def _run(self, index: int, h: SessionHandle, prompt: dict, env: EnvironmentService, pid: str,
                   group_id: str) -> list[Trajectory]:
        member = await env_for(env, index)
        kw: dict[str, Any] = {k: v for k, v in self.args.items()}
        url, key = self.server.session_url(h), self.server.api_key(h)
        given = {"prompt": dict(prompt), "env": member, "base_url": url, "api_key": key}
        kw.update({k: v for k, v in given.items() if self._wants(k)})
        if self._wants("client"):
            kw["client"] = self.server.openai_client().with_options(base_url=url, api_key=key)
        if self._wants("anthropic"):
            kw["anthropic"] = self.server.anthropic_client().with_options(base_url=self.server.session_root(h),
                                                                          api_key=key)
        try:
            result = await self.fn(**kw)
        finally:
            self.server.end_session(h.key)
        return await session_trajectories(self.server, h, member, result, pid, group_id,
                                          f"agent function {self.fn.__name__}")

    async def collect_trajectory(self, prompt: dict[str, Any], env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        await self.server.start()
        if env is not None:  # as the built-in agents do (the worker's env pool reset it too); none in the bench
            await env.reset(options=dict(prompt))
        pid = str(prompt.get("id", "prompt"))
        group_id = new_id(pid)
        generate = queue_client(obs_queue, act_queue).generate
        async with self.server.slots.hold(self.group_size):  # rollout.max_concurrent_sessions
            handles = [self.server.open_session(generate, greedy=self.greedy) for _ in range(self.group_size)]
            try:
                per_session = await gather_or_cancel(self._run(i, h, prompt, env, pid, group_id)
                                                     for i, h in enumerate(handles))
            finally:
                for h in handles:
                    self.server.end_session(h.key)
        late = sum(h.late_calls for h in handles)
        if late:
            raise SessionCallAfterEnd(f"{late} call(s) after their session had ended (a task of the agent "
                                      "function outlived it)")
        trajs = [t for ts in per_session for t in ts]
        if not trajs:
            raise ValueError(f"agent function {self.fn.__name__} made no model call")
        return filter_uniform(trajs, self.filter_uniform_groups)
