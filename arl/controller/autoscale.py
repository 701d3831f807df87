"""`inference.autoscale`: grow the inference fleet while the learner waits for data, shrink it while generation
waits on the learner. Pure: fed samples and counters with the caller's clock, it answers +1, -1 or nothing, with
the signals that decided (the controller's `Scaling` carries it out and records it).

The two signals, each over the last `interval_s`:

* **the learner waits for data**: the share of the learner's time spent waiting for its next batch
  (``idle_seconds`` against ``train_seconds`` from its heartbeats). Above `learner_idle_above`, generation is the
  bottleneck: one more server helps.
* **generation waits on the learner**: the learner hardly waits (at most `learner_idle_below` of its time) and
  rollout workers wait on the staleness gate (the learner is eta versions behind) in at least
  `gate_blocked_above` of the samples: the fleet makes more than the learner takes, one server fewer loses
  nothing. (The gate alone is no signal: with more groups asked for than eta admits it holds them back whichever
  side is slow.)

After a change nothing is decided for `cooldown_s` (a joining server needs time to load weights and fill up), or
while a server is still joining; the fleet stays within [`min_servers`, `max_servers`]. It does not shrink back to
a size at which it saw the learner wait in the last `memory_s` seconds: without that memory a learner that is just
the bottleneck at n servers and starved at n - 1 makes the fleet swing between the two.
"""

from __future__ import annotations

import dataclasses
from typing import Optional


@dataclasses.dataclass(frozen=True)
class AutoscalePolicy:
    min_servers: int = 1
    max_servers: int = 8
    interval_s: float = 10.0
    cooldown_s: float = 20.0
    learner_idle_above: float = 0.3
    learner_idle_below: float = 0.05
    gate_blocked_above: float = 0.5
    memory_s: float = 120.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_servers <= self.max_servers:
            raise ValueError(f"autoscale needs 1 <= min_servers <= max_servers, got {self.min_servers}, "
                             f"{self.max_servers}")
        if self.interval_s <= 0 or self.cooldown_s < 0:
            raise ValueError("autoscale interval_s must be > 0 and cooldown_s >= 0")


@dataclasses.dataclass(frozen=True)
class Decision:
    change: int  # +1 or -1
    reason: str
    learner_idle: Optional[float]
    gate_blocked: float


class Autoscaler:
    def __init__(self, policy: AutoscalePolicy) -> None:
        self.policy = policy
        self._window_start: Optional[float] = None
        self._blocked = self._samples = 0
        self._learner0: Optional[tuple[float, float]] = None  # (idle_s, train_s) at the window's start
        self._last_change = -1e18
        self._starved: dict[int, float] = {}  # fleet size -> when the learner was last seen waiting at it

    def sample(self, gate_blocked: bool) -> None:
        """One sample of whether rollout workers wait on the staleness gate (taken every fraction of a second)."""
        self._samples += 1
        self._blocked += bool(gate_blocked)

    def decide(self, now: float, *, learner_idle_s: float, learner_train_s: float, serving: int,
               joining: int) -> Optional[Decision]:
        """At the end of each interval: +1, -1 or None. `serving`: servers in the run; `joining`: started, not
        serving yet."""
        if self._window_start is None:
            self._reset(now, learner_idle_s, learner_train_s)
            return None
        if now - self._window_start < self.policy.interval_s:
            return None
        idle0, train0 = self._learner0 or (learner_idle_s, learner_train_s)
        d_idle, d_train = learner_idle_s - idle0, learner_train_s - train0
        idle = d_idle / (d_idle + d_train) if d_idle + d_train > 0 else None  # None: no step in the window
        blocked = self._blocked / self._samples if self._samples else 0.0
        self._reset(now, learner_idle_s, learner_train_s)
        p = self.policy
        if joining or now - self._last_change < p.cooldown_s:
            return None
        decision = None
        if idle is None:
            return None
        if idle >= p.learner_idle_above:
            self._starved[serving] = now
        starved_below = now - self._starved.get(serving - 1, -1e18) < p.memory_s
        if idle >= p.learner_idle_above and serving < p.max_servers:
            decision = Decision(+1, f"the learner waited for data {idle:.0%} of the time", idle, blocked)
        elif idle <= p.learner_idle_below and blocked >= p.gate_blocked_above and serving > p.min_servers \
                and not starved_below:
            decision = Decision(-1, f"the learner never waited ({idle:.0%}) and rollout workers waited on the "
                                    f"staleness gate {blocked:.0%} of the time", idle, blocked)
        if decision is not None:
            self._last_change = now
        return decision

    def _reset(self, now: float, idle_s: float, train_s: float) -> None:
        self._window_start, self._learner0 = now, (idle_s, train_s)
        self._blocked = self._samples = 0
