"""The staleness rule, eta (``max_head_offpolicyness``), in one object that admission, the learner and the actor share.

A token made by policy version ``u`` and consumed by the update of version ``v`` lags ``v - u`` versions; eta bounds
that lag. Three places enforce it, all through one `StalenessPolicy` built once per process from the config:

- admission (`arl.rollout.staleness.StalenessGate`): a group may start only while
  ``accepted + running < admission_limit(version, B) = (version + eta + 1) * B``;
- the learner (`arl.learner.worker.LearnerWorker`): a buffered group the version moved past is dropped whole
  (`group_is_stale`), its budget given back;
- the actor (`arl.learner.actor.PPOActor`): what happens to a token beyond eta inside a group that is kept
  (`token_weights`: 'keep', 'drop' out of the loss, or 'downweight' by ``decay ** (lag - eta)``).

Its constructor is where the rule's settings are checked; nothing else checks them again.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Optional, Sequence

import numpy as np

from arl.api.types import Trajectory

STALE_TOKEN_MODES = ("keep", "drop", "downweight")


@dataclasses.dataclass(frozen=True)
class StalenessPolicy:
    """eta and what happens to tokens beyond it.

    Args:
        eta: the most versions a consumed token may lag; None: no bound (tests and benchmarks that train on
            whatever they are given).
        stale_tokens: what the actor does with a kept group's tokens older than ``version - eta``: 'keep' (the
            learner then drops any group holding one), 'drop' or 'downweight' (the learner drops a group only when
            none of its tokens is within the bound).
        decay: 'downweight': a stale token's loss weight is ``decay ** (lag - eta)``.
    """

    eta: Optional[int] = None
    stale_tokens: str = "keep"
    decay: float = 0.5

    def __post_init__(self) -> None:
        mode = str(self.stale_tokens)  # a config's StaleTokens enum is a str
        if mode not in STALE_TOKEN_MODES:
            raise ValueError(f"stale_tokens must be 'keep', 'drop' or 'downweight', got {self.stale_tokens!r}")
        object.__setattr__(self, "stale_tokens", mode)
        if self.eta is not None and self.eta < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0, got {self.eta!r}")
        if mode != "keep" and self.eta is None:
            raise ValueError("stale_tokens='drop'/'downweight' needs max_head_offpolicyness (eta)")
        if mode == "downweight" and not 0.0 <= self.decay <= 1.0:
            raise ValueError(f"stale token decay must be in [0, 1], got {self.decay}")

    # -- admission --------------------------------------------------------------------------------------------
    def admission_limit(self, version: int, batch_size: int, admitted: Optional[int] = None) -> int:
        """The most groups that may be accepted or running while every inference server has `version`: a group
        started now makes tokens of version >= `version` and is consumed by a step <= ``version + eta``.
        `admitted`: a lower eta to admit at (the controller's steering under ``max_head_offpolicyness=auto``);
        never above the bound."""
        bounds = [e for e in (self.eta, admitted) if e is not None]
        if not bounds:
            return sys.maxsize
        return (version + min(bounds) + 1) * batch_size

    # -- the learner: whole groups ----------------------------------------------------------------------------
    def group_is_stale(self, group: Sequence[Trajectory], version: int, policy: Optional[str] = None) -> bool:
        """Whether `group` is too stale to train on at `version` (the learner drops it, its budget returned).

        Only generated tokens count (a trajectory without any, e.g. an answer cut to nothing, never makes its
        group stale). With 'keep' a group with any generated token older than ``version - eta`` is stale: the whole
        group goes, so no consumed token is more than eta behind. With 'drop' and 'downweight' the actor handles
        old tokens one by one, so a group is stale only when every generated token is older than ``version - eta``.
        `policy`: in a run of several policies, only that policy's tokens count (`Trajectory.owned_by`: each policy
        has its own versions); None, the run's own policy.
        """
        if self.eta is None:
            return False
        gen = [g for t in group if len(g := t.versions[t.owned_by(policy)])]
        if not gen:
            return False
        oldest_ok = version - self.eta
        if self.stale_tokens == "keep":
            return min(int(g.min()) for g in gen) < oldest_ok
        return max(int(g.max()) for g in gen) < oldest_ok

    def exceeded(self, head_offpolicyness: float) -> bool:
        """Whether a trained batch whose oldest token (as received) lagged `head_offpolicyness` versions broke the
        bound. Only 'keep' can consume a token beyond eta: 'drop'/'downweight' take it out of the loss (or weight it
        down, as configured)."""
        return self.eta is not None and self.stale_tokens == "keep" and head_offpolicyness > self.eta

    # -- the actor: single tokens -----------------------------------------------------------------------------
    def stale(self, versions: np.ndarray, loss_mask: np.ndarray, version: int) -> np.ndarray:
        """The tokens of `loss_mask` older than ``version - eta`` (none without a bound)."""
        m = np.asarray(loss_mask).astype(bool)
        if self.eta is None:
            return np.zeros(m.shape, bool)
        return m & (version - np.asarray(versions, dtype=np.int64) > self.eta)

    def token_weights(self, versions: np.ndarray, loss_mask: np.ndarray,
                      version: int) -> tuple[np.ndarray, np.ndarray]:
        """``(loss_mask, weights)`` for a trajectory consumed at `version`: 'keep' leaves both (weights 1), 'drop'
        takes stale tokens out of the mask (they count in neither the sum nor the token count), 'downweight'
        weights them ``decay ** (lag - eta)`` (they stay in the token count)."""
        m = np.asarray(loss_mask).astype(bool)
        stale = self.stale(versions, m, version)
        if self.stale_tokens == "drop":
            return m & ~stale, np.ones(m.shape, np.float32)
        if self.stale_tokens == "keep":
            return m, np.ones(m.shape, np.float32)
        excess = np.maximum(version - np.asarray(versions, dtype=np.int64) - self.eta, 0)
        return m, np.where(stale, np.power(float(self.decay), excess), 1.0).astype(np.float32)
