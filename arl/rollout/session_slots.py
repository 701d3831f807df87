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
from typing import Any, AsyncIterator, Optional

__all__ = ["SessionSlots", "SaturationWatch", "session_limit", "saturation_warning"]


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


def saturation_warning(agent: str, slots: SessionSlots, *, children: int, loop_cpu: Optional[float], load: float,
                       cpus: int) -> Optional[str]:
    """The line a worker says once when its agent saturates the machine: more live child processes than 2 per CPU
    (sessions that each start a program), or the worker's own loop using a whole CPU (`loop_cpu`, percent averaged
    over a window; None until the window is full) while the machine is loaded. None when neither."""
    cap = f"rollout.max_concurrent_sessions (now {slots.limit or 'no cap'})"
    if children > 2 * cpus:
        return (f"agent {agent} runs {children} processes on {cpus} CPUs ({slots.running} sessions running, "
                f"{slots.waiting} waiting; load average {load:.1f}): lower {cap}")
    if loop_cpu is not None and loop_cpu >= 95 and slots.running > 0 and load > 2 * cpus:
        return (f"the worker's event loop is saturated running agent {agent} ({loop_cpu:.0f}% of a CPU, "
                f"{slots.running} sessions; load average {load:.1f} on {cpus} CPUs): the rollout worker bounds the "
                f"run; add rollout workers (rollout.num_workers) or lower {cap}")
    return None


class SaturationWatch:
    """Samples the worker process at each heartbeat (`psutil`): its live children and its CPU over the last
    `window` samples; `check()` returns the warning once it applies (and the same text after)."""

    def __init__(self, agent: str, slots: SessionSlots, cpus: Optional[int] = None, window: int = 10,
                 process: Any = None) -> None:
        import psutil

        self.agent, self.slots, self.cpus = agent, slots, cpus or os.cpu_count() or 1
        self.process = process or psutil.Process()
        self.process.cpu_percent(None)  # the first reading starts the interval
        self._cpu: collections.deque[float] = collections.deque(maxlen=window)
        self.said: Optional[str] = None

    def check(self) -> Optional[str]:
        if self.said is None:
            self._cpu.append(self.process.cpu_percent(None))
            full = len(self._cpu) == self._cpu.maxlen
            self.said = saturation_warning(self.agent, self.slots, children=len(self.process.children(recursive=True)),
                                           loop_cpu=sum(self._cpu) / len(self._cpu) if full else None,
                                           load=os.getloadavg()[0], cpus=self.cpus)
        return self.said
