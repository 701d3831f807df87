"""Prompt streams: which training row a rollout worker draws next, exactly resumable.

Why streams and not workers: a stream's positions are what the learner's checkpoint settles (`DataPosition`, keyed by
stream id), so a stream must outlive the worker that draws it. The run's first ``rollout.num_workers`` streams shard
each pass of the data (stream ``s`` is worker ``s``'s); a worker that joins mid-run gets a new stream of its own id
(every row, its own order); a worker that leaves hands its streams to one that stays (`PromptStreams.adopt`), which
draws them in turn with its own, so no prompt of a stream is skipped and none drawn twice.
"""

from __future__ import annotations

import collections
import random
from typing import Any, Callable, Mapping, Sequence

from arl.data.position import DataPosition

__all__ = ["PromptStream", "PromptStreams"]


class PromptStream:
    """Endless shuffled passes over the training rows; stream ``s < num_shards`` takes every k-th row of a pass.

    Pass ``e`` is shuffled by its own RNG seeded with ``(seed, e)``, so any position's row is known without
    replaying the stream: a resumed run `restore`s the checkpoint's exact data position (`DataPosition`) and draws
    its unsettled positions again first, then fresh ones from one past the highest settled.
    """

    def __init__(self, rows: Sequence[dict], seed: int, shard: int = 0, num_shards: int = 1) -> None:
        if not rows:
            raise ValueError("the training data set is empty")
        self._rows = list(rows)
        self._shard, self._num_shards = shard, num_shards
        self._seed = seed
        self._orders: dict[int, list[int]] = {}  # the last two passes' orders (a re-draw may reach back one)
        self._per_pass = len(self._pass(0))
        # a restore's re-draw, walked lazily (a bogus settled position far ahead costs nothing): positions from
        # `_cursor` up to `position` not in `_skip`; and positions put back (their groups were lost), drawn first
        self._cursor = 0
        self._skip: set[int] = set()
        self._back: collections.deque[int] = collections.deque()
        self.position = 0  # the next fresh position (every position below it was drawn)

    def _pass(self, epoch: int) -> list[int]:
        order = self._orders.get(epoch)
        if order is None:
            order = list(range(len(self._rows)))
            if self._shard < self._num_shards:  # one of the run's first shards: every k-th row of a pass
                random.Random(f"{self._seed}:{epoch}").shuffle(order)
                order = order[self._shard :: self._num_shards] or order
            else:  # a stream added mid-run (a rollout worker that joined): every row, in its own order
                random.Random(f"{self._seed}:{epoch}:{self._shard}").shuffle(order)
            if len(self._orders) >= 2:
                self._orders.pop(next(iter(self._orders)))
            self._orders[epoch] = order
        return order

    def sibling(self, shard: int) -> "PromptStream":
        """Stream `shard` of the same rows, seed and first shard count."""
        return PromptStream(self._rows, self._seed, shard=shard, num_shards=self._num_shards)

    def row(self, position: int) -> dict:
        """The row drawn at `position`."""
        epoch, offset = divmod(int(position), self._per_pass)
        return self._rows[self._pass(epoch)[offset]]

    def restore(self, state: Any, drawn: Sequence[int] = ()) -> None:
        """Continue from a data position (`DataPosition.from_state`'s forms; a bare int: every position below it
        was drawn): its unsettled positions are drawn first, in order, then fresh ones. `drawn`: positions whose
        groups are still running here (a rewind while they run): not drawn again."""
        done = DataPosition.from_state(state)
        running = {int(p) for p in drawn}
        self.position = max([done.next_fresh, *(p + 1 for p in running)])
        self._cursor, self._skip, self._back = done.low, set(done.above) | running, collections.deque()

    def seek(self, position: int) -> None:
        """Continue as if ``position`` prompts had been drawn."""
        if position < 0:
            raise ValueError(f"prompt position must be >= 0, got {position}")
        self.restore(int(position))

    def put_back(self, position: int) -> None:
        """Draw `position` again (next, before fresh ones): its group was lost, not dropped by a rule."""
        if position not in self._back:
            self._back.appendleft(int(position))

    @property
    def redraws(self) -> int:
        """Positions still to be drawn again (a restore's, and those put back)."""
        ahead = sum(1 for p in self._skip if self._cursor <= p < self.position)
        return len(self._back) + self.position - self._cursor - ahead

    def draw(self) -> tuple[int, dict]:
        """(position, row) of the next prompt."""
        if self._back:
            p = self._back.popleft()
            return p, self.row(p)
        while self._cursor < self.position:  # a restore's unsettled positions, in order
            p, self._cursor = self._cursor, self._cursor + 1
            if p in self._skip:
                self._skip.discard(p)
            else:
                return p, self.row(p)
        self._skip.clear()
        p, self.position = self.position, self.position + 1
        self._cursor = self.position
        return p, self.row(p)

    def __next__(self) -> dict:
        return self.draw()[1]


class PromptStreams:
    """The streams one rollout worker draws from, in turn: its own and any it adopted from a worker that left."""

    def __init__(self, make: Callable[[int], PromptStream], own: int) -> None:
        """`make(stream_id)`: a fresh `PromptStream` of that id (the run's data, seed and first shard count)."""
        self._make, self.own = make, own
        self._streams: dict[int, PromptStream] = {own: make(own)}
        self._turn: collections.deque[int] = collections.deque([own])

    @classmethod
    def of(cls, stream: PromptStream, own: int) -> "PromptStreams":
        """`stream` as stream `own`; streams adopted later are built like it (a worker given one stream)."""
        return cls(lambda sid: stream if sid == own else stream.sibling(sid), own)

    @property
    def ids(self) -> list[int]:
        return sorted(self._streams)

    def stream(self, sid: int) -> PromptStream:
        return self._streams[sid]

    def adopt(self, sid: int, state: Any = None, drawn: Sequence[int] = ()) -> None:
        """Draw stream `sid` too (new here: built), continuing from data position `state` (None: as it is)."""
        if sid not in self._streams:
            self._streams[sid] = self._make(sid)
            self._turn.append(sid)
        if state is not None:
            self._streams[sid].restore(state, drawn)

    def restore(self, states: Mapping[int, Any], drawn: Mapping[int, Sequence[int]]) -> None:
        """Each stream of `states` continues from its data position (`PromptStream.restore`); `drawn`: per stream,
        the positions of groups running here."""
        for sid, state in states.items():
            self.adopt(sid, state, drawn.get(sid, ()))

    def draw(self) -> tuple[int, int, dict]:
        """(stream id, position, row) of the next prompt: the streams take turns."""
        sid = self._turn[0]
        self._turn.rotate(-1)
        pos, row = self._streams[sid].draw()
        return sid, pos, row

    def put_back(self, sid: int, position: int) -> None:
        self._streams[sid].put_back(position)

    @property
    def redraws(self) -> int:
        return sum(s.redraws for s in self._streams.values())

    def positions(self) -> dict[int, int]:
        """Stream id -> its next fresh position (for the log)."""
        return {sid: s.position for sid, s in sorted(self._streams.items())}
