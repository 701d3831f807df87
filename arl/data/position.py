"""An exact data position: which prompt-stream positions of one rollout worker are settled, in a compact form.

Why: a resume must re-draw exactly the prompts whose groups had not settled (in flight, buffered at the learner,
trained after the last checkpoint) and no other. "One past the highest position consumed" skips every prompt that
was in flight behind it; a set of every settled position grows with the run. Settled positions are dense behind a
moving front (groups finish roughly in order), so the form is that front, `low` (every position below it is
settled), plus the few settled positions above it.

A position is settled once its group was trained, or dropped by a counted rule (filtered, stale, an error): the
learner books it (`arl.learner.worker`), the checkpoint keeps `to_state()`, and a resumed `PromptStream` draws the
positions at or above `low` that are not in `above` (`arl.rollout.worker.PromptStream.restore`).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator

__all__ = ["DataPosition", "stream_states"]


class DataPosition:
    """Settled positions of one prompt stream: all of ``[0, low)`` and the set `above` (every member > low)."""

    def __init__(self, low: int = 0, above: Iterable[int] = ()) -> None:
        if low < 0:
            raise ValueError(f"data position: low must be >= 0, got {low}")
        self.low = int(low)
        self.above: set[int] = set()
        for p in above:
            self.settle(p)

    def settle(self, position: int) -> bool:
        """Book `position` as settled; False if it already was (a prompt that ended twice)."""
        p = int(position)
        if p < 0:
            raise ValueError(f"data position: a position must be >= 0, got {p}")
        if p < self.low or p in self.above:
            return False
        self.above.add(p)
        while self.low in self.above:  # the front moves over what is now dense
            self.above.discard(self.low)
            self.low += 1
        return True

    def __contains__(self, position: object) -> bool:
        return isinstance(position, int) and (position < self.low or position in self.above)

    def __len__(self) -> int:
        """Settled positions in all."""
        return self.low + len(self.above)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DataPosition) and (self.low, self.above) == (other.low, other.above)

    def __repr__(self) -> str:
        return f"DataPosition(low={self.low}, above={sorted(self.above)[:8]}{'...' if len(self.above) > 8 else ''})"

    @property
    def next_fresh(self) -> int:
        """One past the highest settled position: the first position no group of this stream settled yet."""
        return max(self.above) + 1 if self.above else self.low

    def unsettled(self, below: int) -> Iterator[int]:
        """Positions in ``[low, below)`` not settled, ascending: the ones a resume draws again first."""
        return (p for p in range(self.low, below) if p not in self.above)

    def to_state(self) -> dict[str, Any]:
        """JSON form: ``{"low": int, "above": [int, ...]}`` (sorted)."""
        return {"low": self.low, "above": sorted(self.above)}

    @classmethod
    def from_state(cls, state: Any) -> "DataPosition":
        """Read `to_state()`'s form, or a bare int (a checkpoint of before this form: one past the highest
        consumed position, taken as `low`). Raises ValueError naming what is wrong."""
        if isinstance(state, bool):
            raise ValueError(f"data position must be an int or {{'low', 'above'}}, got {state!r}")
        if isinstance(state, int):
            return cls(state)
        if not isinstance(state, dict) or not isinstance(state.get("low"), int) or isinstance(state["low"], bool):
            raise ValueError(f"data position must be an int or {{'low': int, 'above': [int]}}, got {state!r:.200}")
        above = state.get("above", [])
        if not isinstance(above, list) or not all(isinstance(p, int) and not isinstance(p, bool) for p in above):
            raise ValueError(f"data position 'above' must be a list of ints, got {above!r:.200}")
        return cls(state["low"], above)


def stream_states(state: Any, own: int) -> dict[int, Any]:
    """A worker's prompt position as ``{stream id: DataPosition state}``: the per-stream map (string keys on the
    wire), or one stream's bare state (an int or ``{"low", "above"}``), taken as stream `own`'s. ValueError
    naming what is wrong."""
    if isinstance(state, dict) and "low" not in state:
        out: dict[int, Any] = {}
        for k, v in state.items():
            try:
                sid = int(k)
            except (TypeError, ValueError):
                raise ValueError(f"data position: stream ids must be whole numbers, got {k!r:.40}") from None
            if sid < 0:
                raise ValueError(f"data position: stream ids must be >= 0, got {sid}")
            DataPosition.from_state(v)
            out[sid] = v
        return out
    DataPosition.from_state(state)
    return {own: state}
