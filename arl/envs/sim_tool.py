"""A synthetic tool environment for benchmarks (registered as "sim-tool").

Each step stands for one tool call: it sleeps for a latency drawn from a log-normal distribution, says how many
tokens the tool returned, and after a drawn number of turns ends the chat with a 0/1 reward. Every draw is keyed
by (seed, session, turn), so the same workload takes the same path in every run (synchronous or not, whichever
worker runs it).

Action: ``{"session": str, "turn": int, "n_tokens": int}`` (what the sim agent sends). Anything else ends the
chat with reward 0 and an error in ``info``; ``step`` never raises.
"""

from __future__ import annotations

import asyncio
import math
import zlib
from typing import Any, Optional

import numpy as np

from arl.api import EnvironmentService, register_env


def keyed_rng(*parts: Any) -> np.random.Generator:
    """A generator seeded by a stable hash of `parts` (ints pass through, everything else is crc32'd)."""
    key = [p if isinstance(p, int) and p >= 0 else zlib.crc32(str(p).encode()) for p in parts]
    return np.random.default_rng(key)


class SimToolEnv(EnvironmentService):
    def __init__(self, latency_median_s: float = 0.5, latency_sigma: float = 1.0, time_scale: float = 1.0,
                 turns_min: int = 1, turns_max: int = 4, tool_tokens_median: float = 64.0,
                 tool_tokens_sigma: float = 0.5, reward_p: float = 0.5, seed: int = 0) -> None:
        if latency_median_s < 0 or latency_sigma < 0 or time_scale <= 0:
            raise ValueError("latency_median_s and latency_sigma must be >= 0, time_scale > 0")
        if not 1 <= turns_min <= turns_max:
            raise ValueError(f"need 1 <= turns_min <= turns_max, got {turns_min}, {turns_max}")
        self.latency_median_s, self.latency_sigma = float(latency_median_s), float(latency_sigma)
        self.time_scale = float(time_scale)
        self.turns_min, self.turns_max = int(turns_min), int(turns_max)
        self.tool_tokens_median, self.tool_tokens_sigma = float(tool_tokens_median), float(tool_tokens_sigma)
        self.reward_p = float(reward_p)
        self.seed = int(seed)
        self.steps = 0

    async def reset(self, seed: Optional[int] = None, options: Optional[dict[str, Any]] = None) -> tuple[Any, dict]:
        return None, {}

    def turns(self, session: str) -> int:
        """How many model turns the chat `session` has (keyed draw)."""
        return int(keyed_rng(self.seed, "turns", session).integers(self.turns_min, self.turns_max + 1))

    def latency(self, session: str, turn: int) -> float:
        """Seconds the tool call after `turn` takes (before the time scale)."""
        if self.latency_median_s == 0:
            return 0.0
        rng = keyed_rng(self.seed, "latency", session, turn)
        return float(rng.lognormal(math.log(self.latency_median_s), self.latency_sigma))

    async def step(self, action: Any) -> tuple[Any, float, bool, bool, dict]:
        try:
            session, turn = str(action["session"]), int(action["turn"])
        except (TypeError, KeyError, ValueError) as e:
            return 0, 0.0, True, False, {"error": f"bad action for sim-tool: {type(e).__name__}: {e}"}
        self.steps += 1
        delay = self.latency(session, turn) * self.time_scale
        if delay > 0:
            await asyncio.sleep(delay)
        if turn + 1 >= self.turns(session):
            reward = float(keyed_rng(self.seed, "reward", session).random() < self.reward_p)
            return 0, reward, True, False, {"latency_s": delay}
        rng = keyed_rng(self.seed, "tool_tokens", session, turn)
        n = max(1, int(rng.lognormal(math.log(self.tool_tokens_median), self.tool_tokens_sigma)))
        return n, 0.0, False, False, {"latency_s": delay}


register_env("sim-tool", SimToolEnv)
