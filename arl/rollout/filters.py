"""Trajectory filters applied by the rollout worker before a group goes to the learner, each counted by reason.

- void-turn filter (SimpleTIR): drop trajectories with a void turn, i.e. a turn with neither a tool call nor an
  answer, or one that ended on EOS inside an unclosed tool call (agents report it as `metadata["void_turns"]`;
  the tool agent does). Such turns teach the model nothing useful and destabilise multi-turn training.
- success-rate filter: drop a group whose rewards are all equal (all right or all wrong: zero group advantage,
  no signal), including a group that a filter left with one trajectory.

`apply_filters` returns the kept trajectories, the drop reason of the whole group (None if kept) and counts.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from arl.api.types import Trajectory

__all__ = ["void_turn_filter", "uniform_rewards", "apply_filters"]


def void_turn_filter(trajs: Sequence[Trajectory]) -> tuple[list[Trajectory], int]:
    """(trajectories without a void turn, how many were dropped)."""
    kept = [t for t in trajs if not t.has_void_turn]
    return kept, len(trajs) - len(kept)


def uniform_rewards(trajs: Sequence[Trajectory], tol: float = 1e-9) -> bool:
    rewards = [t.reward for t in trajs]
    return bool(rewards) and all(math.isclose(r, rewards[0], rel_tol=0.0, abs_tol=tol) for r in rewards)


def apply_filters(trajs: Sequence[Trajectory], *, void_turns: bool = False,
                  uniform_groups: bool = False) -> tuple[list[Trajectory], Optional[str], dict[str, int]]:
    """Returns (kept, reason the group was dropped or None, counts)."""
    kept = list(trajs)
    counts = {"void_trajectories": 0}
    if void_turns:
        kept, counts["void_trajectories"] = void_turn_filter(kept)
        if not kept:
            return [], "filtered:void_turns", counts
    if uniform_groups and uniform_rewards(kept):
        return [], "filtered:uniform_reward", counts
    return kept, None, counts
