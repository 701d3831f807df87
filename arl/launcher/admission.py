"""Admission of prompt groups: the staleness gate plus who is waiting for it and who holds what it granted.

Pure bookkeeping, no I/O: every method returns the grants to send, as ``(worker, n)`` pairs, and the controller
sends them. A worker is whatever key the caller uses (the controller uses the rollout worker's index).
"""

from __future__ import annotations

import collections
from typing import Hashable

from arl.rollout.staleness import StalenessGate

Grant = tuple[Hashable, int]  # (worker, number of groups it may start)


class Admission:
    """Rollout workers ask for groups (`acquire`); the gate admits them FIFO while the staleness bound allows.

    Nothing is granted before `open()` (the controller opens after the first evaluation). `held[w]` counts the
    groups granted to `w` and not reported done: they are returned to the gate if `w` is lost, so a dead worker
    cannot keep the run from admitting its last groups.
    """

    def __init__(self, gate: StalenessGate) -> None:
        self.gate = gate
        self.is_open = False
        self.held: collections.Counter = collections.Counter()
        self._wants: collections.deque[list] = collections.deque()  # [worker, remaining]

    def open(self) -> list[Grant]:
        self.is_open = True
        return self.grant()

    def acquire(self, worker: Hashable, want: int) -> list[Grant]:
        if want > 0:
            self._wants.append([worker, want])
        return self.grant()

    def group_done(self, worker: Hashable, accepted: bool) -> list[Grant]:
        """A group `worker` held finished; ValueError if it holds none (a late or duplicate report)."""
        if self.held[worker] <= 0:
            raise ValueError(f"group_done from {worker!r}, which holds no running group")
        self.held[worker] -= 1
        self.gate.finish(accepted)
        return self.grant()

    def groups_dropped(self, n: int) -> list[Grant]:
        """The learner discarded `n` accepted groups (too stale, invalid): their budget comes back."""
        self.gate.drop_accepted(n)
        return self.grant()

    def set_version(self, version: int) -> list[Grant]:
        self.gate.set_version(version)
        return self.grant()

    def worker_lost(self, worker: Hashable) -> tuple[int, list[Grant]]:
        """Forget `worker`'s requests and release what it held; returns (groups lost in flight, new grants)."""
        lost = self.held.pop(worker, 0)
        self.gate.release(lost)
        self._wants = collections.deque(w for w in self._wants if w[0] != worker)
        return lost, self.grant()

    def waiting(self) -> int:
        """Groups asked for and not granted yet."""
        return sum(w[1] for w in self._wants)

    def grant(self) -> list[Grant]:
        """Admit from the head of the queue while the gate has room (FIFO: an early asker is never starved)."""
        out: list[Grant] = []
        while self.is_open and self._wants:
            entry = self._wants[0]
            n = self.gate.try_start(entry[1])
            if n == 0:
                break
            entry[1] -= n
            self.held[entry[0]] += n
            out.append((entry[0], n))
            if entry[1] == 0:
                self._wants.popleft()
        return out
