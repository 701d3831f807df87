"""The task API's episodes: agents that ARL does not start take part in a run through them (`agent.name=external`).

An admitted group of `group_size` offers one episode per member on its rollout worker's `EpisodeBoard`; an agent
anywhere takes one (`POST /rl/v1/episodes`: the prompt row, a session's base URL and key, a deadline, the env's
reset observation), talks to its session in any dialect, and ends it with `POST /rl/v1/episodes/{id}/reward`.
The group waits for every member's reward inside the trajectory deadline: an agent that disappears is timed out
by it and its group dropped with a counted reason, as any other agent's; nothing accepted is lost because an
episode is only a member of a group the worker accounts for as always.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import math
import time
from typing import Any, Optional

from arl.rollout.dialects.common import RequestError

__all__ = ["Episode", "EpisodeBoard", "reward_payload"]


@dataclasses.dataclass(eq=False)
class Episode:
    """One group member handed to an agent outside the run: its session (`handle`), what the agent is given, and
    the future its reward resolves."""

    id: str
    handle: Any
    prompt: dict
    observation: Any
    deadline: float  # time.time() after which the group is dropped
    result: asyncio.Future = dataclasses.field(repr=False)
    claimed: bool = False


def reward_payload(body: Any) -> Any:
    """What `POST .../reward` may carry: {"reward": a finite number | {"reward": a finite number, ...} | null}
    (null: the env scores the episode's last answer)."""
    if not isinstance(body, dict) or "reward" not in body:
        raise RequestError("the body must be an object with 'reward' (a number, an object with 'reward', or null)",
                           "reward")
    r = body["reward"]
    value = r.get("reward") if isinstance(r, dict) else r
    if r is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RequestError(f"reward must be a finite number (or an object with one), got {value!r:.80}", "reward")
    return r


class EpisodeBoard:
    """Episodes offered, taken and rewarded in one rollout worker; long-polling takers wait in FIFO order."""

    def __init__(self, max_ended: int = 10_000) -> None:
        self._open: collections.deque[Episode] = collections.deque()
        self._takers: collections.deque[asyncio.Future] = collections.deque()
        self.episodes: dict[str, Episode] = {}
        self._ended: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> why it ended
        self._max_ended = max_ended
        self.stats: collections.Counter = collections.Counter()

    def offer(self, ep: Episode) -> None:
        self.episodes[ep.id] = ep
        self.stats["offered"] += 1
        while self._takers:
            taker = self._takers.popleft()
            if not taker.done():
                ep.claimed = True
                taker.set_result(ep)
                return
        self._open.append(ep)

    async def take(self, wait_s: float) -> Optional[Episode]:
        """The oldest open episode, waiting up to `wait_s` for one (None: none came)."""
        while self._open:
            ep = self._open.popleft()
            if ep.id in self.episodes:
                ep.claimed = True
                self.stats["handed_out"] += 1
                return ep
        if wait_s <= 0:
            return None
        taker: asyncio.Future = asyncio.get_running_loop().create_future()
        self._takers.append(taker)
        try:
            ep = await asyncio.wait_for(asyncio.shield(taker), wait_s)
        except asyncio.TimeoutError:
            if not taker.done():
                taker.cancel()
                return None
            ep = taker.result()  # handed over as the wait ran out: it is this caller's
        except asyncio.CancelledError:  # the caller hung up: an episode handed over meanwhile goes back
            if taker.done() and not taker.cancelled():
                back = taker.result()
                back.claimed = False
                self._open.appendleft(back)
            else:
                taker.cancel()
            raise
        self.stats["handed_out"] += 1
        return ep

    def reward(self, episode_id: str, payload: Any) -> None:
        ep = self.episodes.get(episode_id)
        if ep is None:
            why = self._ended.get(episode_id)
            if why is None:
                raise RequestError(f"unknown episode {episode_id!r}", status=404, code="episode_not_found")
            raise RequestError(f"episode {episode_id} has ended ({why})", status=409, code="episode_ended")
        if not ep.claimed:
            raise RequestError(f"episode {episode_id} was never handed out", status=409, code="episode_not_taken")
        if time.time() > ep.deadline:
            raise RequestError(f"episode {episode_id} is past its deadline", status=409, code="episode_ended")
        if ep.result.done():
            raise RequestError(f"episode {episode_id} already has its reward", status=409, code="episode_ended")
        ep.result.set_result(payload)
        self.stats["rewarded"] += 1

    def end(self, ep: Episode, why: str) -> None:
        """The group is over (rewarded, dropped, past its deadline): the episode leaves the board."""
        if self.episodes.pop(ep.id, None) is None:
            return
        try:
            self._open.remove(ep)
            self.stats["withdrawn_unclaimed"] += 1
        except ValueError:
            pass
        unrewarded = not ep.result.done() or ep.result.cancelled()  # a cancelled group cancels what it awaited
        ep.result.cancel()
        if ep.claimed and unrewarded:
            self.stats["expired_claimed"] += 1
        self._ended[ep.id] = why
        while len(self._ended) > self._max_ended:
            self._ended.popitem(last=False)

    @property
    def open(self) -> int:
        return len(self._open)
