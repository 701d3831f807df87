"""At most N agent sessions at once in one rollout worker (`rollout.max_concurrent_sessions`).

Why: an agent function that starts a process per session (the documented way for programs: `base_url` /
`api_key` in a subprocess's environment) or builds its own HTTP client costs far more than a coroutine. Without a
cap a worker that runs 64 groups of 8 starts 512 processes at once on 2 cores: nothing fails, nothing says why,
and the run crawls. The worker also asks the staleness gate for no more groups than the cap lets run
(`max_groups`), so an admitted group rarely waits here; what does wait (evaluation beside training) waits in FIFO
order and keeps its admission. `running` and `waiting` ride on the heartbeat and the progress line.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
from typing import AsyncIterator, Optional

__all__ = ["SessionSlots", "session_limit", "saturation_warning"]


def session_limit(setting: int, in_process: bool, cpus: Optional[int] = None) -> int:
    """`rollout.max_concurrent_sessions` as a number (0: no cap). Auto (0): no cap when a session costs this worker
    no process (`in_process`: an in-process client, or an agent outside the run), 4 per CPU for agents that take
    `base_url` / `api_key` (a session may be a process or an HTTP client of its own)."""
    if setting > 0:
        return setting
    return 0 if in_process else 4 * (cpus or os.cpu_count() or 1)


class SessionSlots:
    """A FIFO counting semaphore over sessions; a group takes all its sessions' slots at once (so its members
    never wait on each other), at most `limit` (a group larger than the cap runs alone)."""

    def __init__(self, limit: int = 0) -> None:
        self.limit = int(limit)
        self.running = 0
        self.waiting = 0
        self._queue: collections.deque[tuple[asyncio.Future, int]] = collections.deque()

    def max_groups(self, group_size: int) -> Optional[int]:
        """Most groups of `group_size` that run at once under the cap (None: no cap)."""
        return max(1, self.limit // max(1, group_size)) if self.limit else None

    def _wake(self) -> None:
        while self._queue and self.running + self._queue[0][1] <= self.limit:
            fut, n = self._queue.popleft()
            if not fut.done():
                self.running += n
                fut.set_result(None)

    async def _acquire(self, n: int) -> None:
        if not self.limit or (not self._queue and self.running + n <= self.limit):
            self.running += n
            return
        entry = (asyncio.get_running_loop().create_future(), n)
        self._queue.append(entry)
        self.waiting += n
        try:
            await entry[0]
        except asyncio.CancelledError:
            if entry[0].done() and not entry[0].cancelled():  # granted, then cancelled before it ran: give back
                self.running -= n
            else:
                self._queue.remove(entry)
            self._wake()
            raise
        finally:
            self.waiting -= n

    @contextlib.asynccontextmanager
    async def hold(self, sessions: int) -> AsyncIterator[None]:
        n = min(sessions, self.limit) if self.limit else sessions
        await self._acquire(n)
        try:
            yield
        finally:
            self.running -= n
            self._wake()


def saturation_warning(agent: str, slots: SessionSlots, load: float, cpus: int) -> Optional[str]:
    """The line a worker says once when its machine is saturated while its agent's sessions run (a load average
    over 2 per CPU): what to lower, named."""
    if load <= 2 * cpus or slots.running == 0:
        return None
    cap = f"rollout.max_concurrent_sessions={slots.limit}" if slots.limit else "rollout.max_concurrent_sessions (no cap)"
    return (f"the machine is saturated (load average {load:.1f} on {cpus} CPUs) while agent {agent} runs "
            f"{slots.running} sessions ({slots.waiting} waiting): lower {cap}, or give each session less to do")
