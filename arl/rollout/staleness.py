"""The bounded-staleness gate (AReaL's staleness manager), pure logic with no I/O.

A prompt group may start only while `accepted + running` is below the run's `StalenessPolicy.admission_limit`,
``(version + eta + 1) * batch_size``, and `running < max_concurrent`. With eta = 0 this alone is synchronous PPO;
for eta > 0 the learner also drops groups that finished too late (see `drop_accepted`), which makes the bound hard.
`version` is the policy version every inference worker has loaded, so a group that starts under version v makes
tokens of version >= v and is consumed by a learner step <= v + eta.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

from arl.api.staleness import StalenessPolicy

_GROUP_ID = re.compile(r"w(\d+)\.([0-9a-f]+)g(\d+)")


def make_group_id(worker: int, incarnation: str, n: int) -> str:
    """The id of the `n`-th group of rollout worker `worker`'s `incarnation` (a random hex per process): unique
    across restarts, and it names the worker that holds the group (`parse_group_id`)."""
    return f"w{worker}.{incarnation}g{n}"


def parse_group_id(group_id: str) -> Optional[tuple[int, str]]:
    """(worker index, incarnation) of a `make_group_id` id (the part before a trajectory's ':'), else None."""
    m = _GROUP_ID.fullmatch(group_id.split(":", 1)[0])
    return (int(m.group(1)), m.group(2)) if m else None


@dataclasses.dataclass
class StalenessGate:
    batch_size: int
    policy: StalenessPolicy  # eta: the run's one staleness rule
    max_concurrent: int
    version: int = 0
    accepted: int = 0
    running: int = 0
    started: int = 0
    rejected: int = 0  # finished groups that produced no trajectories (filtered, failed, timed out)
    max_groups: int | None = None  # stop admitting after this many accepted + running (end of the run)
    owed: int = 0  # learner drops that came before their group was accepted: taken from the next accepted ones
    admitted_eta: Optional[int] = None  # the eta admitted at, below the policy's bound (auto); None: the bound
    learner_dropped: int = 0  # accepted groups the run's learner dropped (`drop_accepted`), in all
    # trainable listed policies (docs/multi_policy.md): name -> (its version live on every server, the groups its
    # learner dropped in all); its learner trains the same groups, so its bound holds as well
    others: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def capacity(self) -> int:
        """How many more groups may start right now: under every trained policy's bound. A listed policy's
        learner holds the groups the run's learner accepted, less those it dropped and plus those the run's
        learner dropped (the gate's `accepted` already gave those back)."""
        # (live version, groups held) per trained policy (the run's alone without `others`); one that holds all
        # the run's groups is done, and its bound no longer holds the others back (their learners dropped more)
        held = [(self.version, self.accepted)] + [(v, self.accepted + self.learner_dropped - dropped)
                                                  for v, dropped in self.others.values()]
        needing = [(v, h) for v, h in held if self.max_groups is None or h < self.max_groups]
        if not needing:
            return 0
        limit = lambda v: self.policy.admission_limit(v, self.batch_size, self.admitted_eta)  # noqa: E731
        cap = min(min(limit(v) - h for v, h in needing), self.max_concurrent) - self.running
        if self.max_groups is not None:  # the end of the run: until the policy that holds fewest has all it needs
            cap = min(cap, self.max_groups - (min(h for _, h in needing) + self.running))
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
        if accepted and self.owed:  # the learner dropped it already (its drop overtook this report)
            self.owed -= 1
            self.rejected += 1
        elif accepted:
            self.accepted += 1
        else:
            self.rejected += 1

    def drop_accepted(self, n: int) -> None:
        """The learner discarded n accepted groups as too stale: give their budget back.

        The gate alone bounds staleness only if groups finish in the order they started; a long-tailed group
        can finish after younger ones have moved the version on. The learner drops such groups at consumption
        (so no consumed token is ever more than eta behind) and the gate lets replacements start. A drop that
        arrives before its group's acceptance (the learner reports on another connection than the rollout
        worker) is owed and taken when that group is accepted, not lost.
        """
        self.learner_dropped += n
        k = min(n, self.accepted)
        self.accepted -= k
        self.rejected += k
        self.owed = min(self.owed + n - k, self.running)  # only a running group can still be accepted

    def reclaim(self, n: int) -> None:
        """`n` groups released as lost (`release`) reached the learner after all: they count as accepted."""
        n = min(n, self.rejected)
        self.rejected -= n
        self.accepted += n

    def release(self, n: int) -> None:
        """Return budget of groups that were admitted but never ran (a worker died or shut down)."""
        n = min(n, self.running)
        self.running -= n
        self.rejected += n
        self.owed = min(self.owed, self.running)

    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went backwards: {self.version} -> {version}")
        self.version = version
