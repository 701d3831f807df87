"""Which policy versions are evaluated, and when the run is done. Pure: no I/O, no clock.

The start version is evaluated before admission opens: version 0 as soon as every role registered, a resumed
run's version once the checkpoint's weights are live on every server. Then every `every`-th version and the last
one: a version skipped by coalesced weight updates still counts, so an evaluation due at it runs at the version
that went live instead. Evaluations run on rollout worker 0; one that restarts gets the pending ones again. The
run is done once the last version's evaluation and every earlier one are in.
"""

from __future__ import annotations


class EvalSchedule:
    def __init__(self, *, total_steps: int, every: int, start_version: int = 0) -> None:
        self.total_steps, self.every, self.start_version = total_steps, every, start_version
        self.requested: set[int] = set()
        self.done: set[int] = set()
        self._lost: set[int] = set()  # versions asked for before a rollback took them back, not asked since

    def pending(self) -> list[int]:
        """Versions whose evaluation was requested and has no result yet (to ask again after a restart)."""
        return sorted(self.requested - self.done)

    def awaiting_start(self) -> bool:
        """The start version's evaluation was neither requested nor reported yet (admission opens once it is in)."""
        return self.start_version not in self.requested | self.done

    def request(self, version: int) -> list[int]:
        self._lost.discard(version)
        self.requested.add(version)
        return [version]

    def live(self, previous: int, version: int, gate_version: int) -> list[int]:
        """`version` went live on every server (after `previous`), the gate being at `gate_version`: the versions
        to evaluate now. One not above the gate is a resumed run's checkpoint weights: its start evaluation."""
        if version <= gate_version:
            return self.request(version) if version == self.start_version and self.awaiting_start() else []
        due = version >= self.total_steps or (self.every and any(
            u % self.every == 0 for u in range(previous + 1, version + 1)))
        return self.request(version) if due else []

    def rollback(self, version: int) -> None:
        """The learner restarted from checkpoint `version`: versions after it are trained again, so they are
        evaluated again when reached (a late result of a lost one is ignored)."""
        self._lost |= {v for v in self.requested | self.done if v > version}
        self.requested = {v for v in self.requested if v <= version}
        self.done = {v for v in self.done if v <= version}

    def finished(self, version: int) -> tuple[bool, bool]:
        """The evaluation of `version` is in: (it was the start version's, so admission opens; the run is done: the
        last version's evaluation is in and no other is pending, in whatever order they came). A version not asked
        for (a lost policy's, asked before a rollback and not since) counts for nothing."""
        if version in self._lost and version not in self.requested:
            return False, False
        self.done.add(version)
        return version == self.start_version, max(self.done) >= self.total_steps and not self.pending()
