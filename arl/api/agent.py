"""Agent and environment contracts (gym-style, async)."""

from __future__ import annotations

import abc
import asyncio
from typing import Any, Optional

from arl.api.types import Trajectory


class EnvironmentService(abc.ABC):
    """An async gym-style environment. CPU-heavy work must run off the event loop with a timeout."""

    async def reset(self, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None) -> tuple[Any, dict]:
        return None, {}

    @abc.abstractmethod
    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        """Returns (obs, reward, terminated, truncated, info)."""

    async def close(self) -> None:
        return None


class Agent(abc.ABC):
    """Turns one prompt into trajectories by talking to the engine through two queues.

    Put a `GenerateRequest` (or the AReaL-style tuple `(qid, token_ids, gconfig)`) on `obs_queue`; the matching
    `GenerateResponse` arrives on `act_queue`. Return `[]` to drop the prompt.

    An `obs_queue` may also offer ``async generate(req) -> GenerateResponse``: the same request and answer without
    the trip through `act_queue` (the rollout worker's does; ``arl.agents.common.generate`` uses it when present,
    which saves two event-loop wakes per turn). Agents that use the queues directly need not care.
    """

    @abc.abstractmethod
    async def collect_trajectory(self, prompt: dict[str, Any], env: EnvironmentService, obs_queue: asyncio.Queue,
                                 act_queue: asyncio.Queue) -> list[Trajectory]:
        ...
