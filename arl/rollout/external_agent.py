"""`agent.name=external`: the group's members are episodes of the task API (`arl.rollout.episodes`), run by
agents the trainer does not start: another process, another machine, another language. The rollout worker
admits the group through the staleness gate, opens one endpoint session per member, offers the episodes, and
waits for their rewards within the trajectory deadline; then each session's turns become trajectories exactly as
for an agent function (`session_trajectories`).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from typing import Any

from arl.agents.common import env_for, filter_uniform, gather_or_cancel, new_id, queue_client
from arl.api.agent import Agent, EnvironmentService
from arl.api.types import Trajectory
from arl.rollout.endpoint import EndpointServer
from arl.rollout.episodes import Episode
from arl.rollout.openai_agent import session_trajectories

__all__ = ["ExternalAgent"]


def _json_safe(obs: Any) -> Any:
    try:
        json.dumps(obs)
        return obs
    except (TypeError, ValueError):
        return str(obs)


class ExternalAgent(Agent):
    """Offers `group_size` episodes per prompt on the worker's task API and turns their sessions into the group.

    Args:
        server: the worker's endpoint (its `board` hands the episodes out).
        group_size: episodes (members) per prompt.
        deadline_s: how long an episode may take (the trajectory deadline: past it the group is dropped).
        greedy: evaluation: every request of these sessions is decoded greedily.
        filter_uniform_groups: drop a group whose rewards are all equal.
    """

    def __init__(self, server: EndpointServer, group_size: int = 1, deadline_s: float = 600.0, greedy: bool = False,
                 filter_uniform_groups: bool = False) -> None:
        self.server, self.group_size, self.deadline_s = server, int(group_size), float(deadline_s)
        self.greedy, self.filter_uniform_groups = greedy, filter_uniform_groups

    async def _member(self, index: int, ep: Episode, env: EnvironmentService, pid: str,
                      group_id: str) -> list[Trajectory]:
        member = await env_for(env, index)
        payload = await ep.result
        self.server.end_session(ep.handle.key)
        return await session_trajectories(self.server, ep.handle, member, payload, pid, group_id,
                                          f"external episode {ep.id}")

    async def collect_trajectory(self, prompt: dict[str, Any], env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        await self.server.start()
        observation = None
        if env is not None:
            observation, _ = await env.reset(options=dict(prompt))
        pid = str(prompt.get("id", "prompt"))
        group_id = new_id(pid)
        generate = queue_client(obs_queue, act_queue).generate
        loop = asyncio.get_running_loop()
        async with self.server.slots.hold(self.group_size):
            episodes = []
            for _ in range(self.group_size):
                h = self.server.open_session(generate, greedy=self.greedy)
                episodes.append(Episode(f"ep_{secrets.token_hex(10)}", h, dict(prompt), _json_safe(observation),
                                        time.time() + self.deadline_s, loop.create_future()))
            why = "dropped"
            try:
                for ep in episodes:
                    self.server.board.offer(ep)
                per_member = await gather_or_cancel(self._member(i, ep, env, pid, group_id)
                                                    for i, ep in enumerate(episodes))
                why = "rewarded"
            finally:
                for ep in episodes:
                    self.server.board.end(ep, why)
                    self.server.end_session(ep.handle.key)
        trajs = [t for ts in per_member for t in ts]
        if not trajs:
            raise ValueError("the external episodes made no model call")
        return filter_uniform(trajs, self.filter_uniform_groups)
