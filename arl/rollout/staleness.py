"""The bounded-staleness gate (AReaL's staleness manager), pure logic with no I/O.

A prompt group may start only while `accepted + running < (version + eta + 1) * batch_size` and
`running < max_concurrent`. With eta = 0 this alone is synchronous PPO; for eta > 0 the learner also drops groups
that finished too late (see `drop_accepted`), which makes the bound hard. `version` is the policy version every inference worker has loaded, so a group that
starts under version v makes tokens of version >= v and is consumed by a learner step <= v + eta.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class StalenessGate:
    batch_size: int
    max_head_offpolicyness: int
    max_concurrent: int
    version: int = 0
    accepted: int = 0
    running: int = 0
    started: int = 0
    rejected: int = 0  # finished groups that produced no trajectories (filtered, failed, timed out)
    max_groups: int | None = None  # stop admitting after this many accepted + running (end of the run)

    def capacity(self) -> int:
        """How many more groups may start right now."""
        by_staleness = (self.version + self.max_head_offpolicyness + 1) * self.batch_size - self.accepted
        cap = min(by_staleness, self.max_concurrent) - self.running
        if self.max_groups is not None:
            cap = min(cap, self.max_groups - (self.accepted + self.running))
        return max(0, cap)

    def try_start(self, n: int = 1) -> int:
        """Admit up to n groups; returns how many were admitted."""
        k = min(n, self.capacity())
        self.running += k
        self.started += k
        return k

    def finish(self, accepted: bool) -> None:
        if self.running <= 0:
            raise RuntimeError("StalenessGate.finish called with no running group")
        self.running -= 1
        if accepted:
            self.accepted += 1
        else:
            self.rejected += 1

    def drop_accepted(self, n: int) -> None:
        """The learner discarded n accepted groups as too stale: give their budget back.

        The gate alone bounds staleness only if groups finish in the order they started; a long-tailed group
        can finish after younger ones have moved the version on. The learner drops such groups at consumption
        (so no consumed token is ever more than eta behind) and the gate lets replacements start.
        """
        n = min(n, self.accepted)
        self.accepted -= n
        self.rejected += n

    def release(self, n: int) -> None:
        """Return budget of groups that were admitted but never ran (a worker died or shut down)."""
        n = min(n, self.running)
        self.running -= n
        self.rejected += n

    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went backwards: {self.version} -> {version}")
        self.version = version
