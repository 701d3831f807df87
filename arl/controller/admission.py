"""Admission of prompt groups: the staleness gate plus who is waiting for it and who holds what it granted.

Pure bookkeeping, no I/O: every method returns the grants to send, as ``(worker, n)`` pairs, and the controller
sends them. A worker is whatever key the caller uses (the controller uses the rollout worker's index).

A group ends once: by its worker's ``group_done`` or by the learner's receipt (`received`), whichever comes first.
The receipt is what makes a group trained by the learner count as accepted when its worker died between pushing
it and reporting it (it would otherwise be released as lost, its budget given back, and admitted again).
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Hashable, Optional

from arl.api.staleness import StalenessPolicy
from arl.controller.steering import StalenessChange, StalenessSteering
from arl.rollout.staleness import StalenessGate

logger = logging.getLogger("arl.controller")

Grant = tuple[Hashable, int]  # (worker, number of groups it may start)


class Admission:
    """Rollout workers ask for groups (`acquire`); the gate admits them while the staleness bound allows, one group
    at a time to each waiting worker in turn (round robin, in the order they first asked).

    Why in turn and not FIFO over requests: a worker asks for all it can run (its capacity), so under FIFO the first
    asker took every admission until its whole request was served, and a worker that joined mid-run (or came back)
    waited idle behind it for as long as the gate stayed the bottleneck.

    Nothing is granted before `open()` (the controller opens after the first evaluation). `held[w]` counts the
    groups granted to `w` and not reported done: they are returned to the gate if `w` is lost, so a dead worker
    cannot keep the run from admitting its last groups.
    """

    def __init__(self, gate: StalenessGate, max_remembered: int = 1 << 16, max_closed: int = 1 << 12,
                 steering: Optional[StalenessSteering] = None) -> None:
        self.gate = gate
        self.steering = steering  # max_head_offpolicyness=auto: the gate admits at the eta it steers to
        if steering is not None:
            gate.admitted_eta = steering.eta
        self.is_open = False
        self.held: collections.Counter = collections.Counter()
        self._wants: collections.OrderedDict[Hashable, int] = collections.OrderedDict()  # worker -> not granted
        self.incarnation: dict[Hashable, str] = {}  # the process whose groups `held[w]` counts (from acquire)
        # how far each group got (`_note`): open ones wait for their other half (group_done or the learner's
        # receipt, seconds apart); closed ones are kept only to refuse a duplicate, the newest `max_closed` of them,
        # so the controller's memory stays flat over a run of days (all in one map it filled for 65,536 groups)
        self._groups: collections.OrderedDict[str, tuple[str, Hashable, int]] = collections.OrderedDict()
        self._closed: collections.OrderedDict[str, Hashable] = collections.OrderedDict()
        self._lost: collections.Counter = collections.Counter()  # (w, incarnation) -> groups released as lost
        self.max_remembered, self.max_closed = max_remembered, max_closed
        self._reopen_at: Optional[int] = None  # paused for a lost learner: reopens when this version is live
        self.leaving: set[Hashable] = set()  # workers draining out of the run: asked for nothing more

    def open(self) -> list[Grant]:
        self.is_open = True
        return self.grant()

    def acquire(self, worker: Hashable, want: int, incarnation: Optional[str] = None) -> list[Grant]:
        """`worker` (its process `incarnation`, which names its groups' ids) wants `want` more groups."""
        if incarnation is not None and self.incarnation.get(worker) != incarnation:
            self.incarnation[worker] = incarnation  # a process's first request: one line (a joiner's first word)
            logger.info("admission: rollout%s asks for its first %d groups (%d running, %d asked for by others)",
                        worker, want, self.gate.running, self.waiting())
        if want > 0 and worker not in self.leaving:
            self._wants[worker] = self._wants.get(worker, 0) + want  # a worker waiting keeps its turn
        return self.grant()

    def group_done(self, worker: Hashable, accepted: bool, group_id: Optional[str] = None) -> list[Grant]:
        """A group `worker` held finished; ValueError if it holds none or reported this one before (a late or
        duplicate report). A group the learner's receipt settled already is not settled again."""
        if group_id is not None and (group_id in self._groups or group_id in self._closed):
            state, holder, _ = self._groups.get(group_id, ("closed", None, 0))
            if state != "received" or holder != worker:
                raise ValueError(f"group_done for group {group_id!r} again")
            self._note(group_id, "closed", worker)
            return []
        if self.held[worker] <= 0:
            raise ValueError(f"group_done from {worker!r}, which holds no running group")
        self.held[worker] -= 1
        self.gate.finish(accepted)
        if group_id is not None:  # an accepted one's receipt is still to come: it must not settle it again
            self._note(group_id, "done" if accepted else "closed", worker)
        return self.grant()

    def received(self, worker: Hashable, incarnation: str, group_id: str, n_traj: int = 0) -> str:
        """The learner received group `group_id` of `worker`'s process `incarnation`: the group is accepted,
        whatever happens to the worker. Returns 'known' (its group_done came first, or a duplicate receipt),
        'settled' (running: accepted now; its group_done will not settle it again), 'reclaimed' (its worker died
        and it was released as lost: accepted now) or 'unknown' (no group of this run's workers)."""
        if group_id in self._groups or group_id in self._closed:
            state, holder, _ = self._groups.get(group_id, ("closed", None, 0))
            if state == "done":
                self._note(group_id, "closed", holder)
            return "known"
        if incarnation == self.incarnation.get(worker) and self.held[worker] > 0:
            self.held[worker] -= 1
            self.gate.finish(True)
            self._note(group_id, "received", worker, n_traj)
            return "settled"
        if self._lost[(worker, incarnation)] > 0:
            self._lost[(worker, incarnation)] -= 1
            self.gate.reclaim(1)
            self._note(group_id, "closed", worker)
            return "reclaimed"
        return "unknown"

    def _note(self, group_id: str, state: str, worker: Hashable, n_traj: int = 0) -> None:
        """Remember how far group `group_id` got ('done': group_done came, 'received': its receipt came, 'closed':
        both, or it was rejected); the oldest are forgotten beyond `max_remembered` (both come within seconds)."""
        if state == "closed":
            self._groups.pop(group_id, None)
            self._closed[group_id] = worker
            while len(self._closed) > self.max_closed:
                self._closed.popitem(last=False)
            return
        self._groups[group_id] = (state, worker, int(n_traj))
        while len(self._groups) > self.max_remembered:
            self._groups.popitem(last=False)

    def groups_dropped(self, n: int) -> list[Grant]:
        """The learner discarded `n` accepted groups (too stale, invalid): their budget comes back."""
        self.gate.drop_accepted(n)
        return self.grant()

    def set_version(self, version: int) -> list[Grant]:
        self.gate.set_version(version)
        return self.grant()

    def stepped(self, version: int, metrics: dict,
                on_change: Callable[[StalenessChange], None] = lambda change: None) -> list[Grant]:
        """The learner published `version` with its step's `metrics`: with a steering, its health signals may move
        the admitted eta (`on_change` hears of it); a raise makes room at once."""
        change = self.steering.observe(version, metrics) if self.steering is not None else None
        if change is None:
            return []
        self.gate.admitted_eta = change.new
        on_change(change)
        return self.grant()

    def went_live(self, version: int) -> list[Grant]:
        """`version` is live on every inference server: the gate moves on to it (never back), and admission
        reopens if it waited for a rollback's version (`rollback`)."""
        if version > self.gate.version:
            self.gate.set_version(version)
        if self._reopen_at is not None and version >= self._reopen_at:
            self._reopen_at, self.is_open = None, True
        return self.grant()

    def pause(self) -> None:
        """The learner is lost: nothing is granted until it is back and its checkpoint's weights are live (queued
        requests wait; running groups go on)."""
        if self.is_open:
            self._reopen_at = self.gate.version
        self.is_open = False

    def rollback(self, version: int, accepted: int) -> None:
        """The restarted learner resumed at checkpoint `version`, having consumed `accepted` groups: the gate goes
        back there (groups accepted since are gone with the lost learner; running ones end as they end, by their
        group_done). Admission stays paused until `version` is live (`went_live`); a run that never opened
        (the learner lost before the first evaluation) opens as usual, after it."""
        self.gate.version, self.gate.accepted, self.gate.owed = int(version), int(accepted), 0
        if self._reopen_at is not None:
            self._reopen_at = int(version)

    def worker_lost(self, worker: Hashable) -> tuple[int, list[Grant]]:
        """Forget `worker`'s requests and release what it held; returns (groups lost in flight, new grants).
        Groups the learner has already are not lost (see `orphans`); one of the released groups that reaches the
        learner later is reclaimed by its receipt (`received`)."""
        lost = self.held.pop(worker, 0)
        self.gate.release(lost)
        incarnation = self.incarnation.pop(worker, None)
        if incarnation is not None and lost:
            self._lost[(worker, incarnation)] += lost
        self._wants.pop(worker, None)
        return lost, self.grant()

    def leave(self, worker: Hashable) -> None:
        """`worker` is draining out of the run: what it asked for and was not granted is forgotten, and so is
        anything it asks for later (its running groups end as usual, by their group_done)."""
        self.leaving.add(worker)
        self._wants.pop(worker, None)

    def orphans(self, worker: Hashable) -> list[int]:
        """Forget the groups of `worker` the learner received and whose group_done never came (the worker died):
        they were accepted; returns their trajectory counts, for the accounting."""
        mine = [(g, n) for g, (state, w, n) in self._groups.items() if state == "received" and w == worker]
        for g, _ in mine:
            self._note(g, "closed", worker)
        return [n for _, n in mine]

    def waiting(self) -> int:
        """Groups asked for and not granted yet."""
        return sum(self._wants.values())

    def grant(self) -> list[Grant]:
        """Admit one group to each waiting worker in turn while the gate has room (nobody is starved, and the
        gate's room is shared evenly among those asking); one `(worker, n)` per worker granted, in grant order."""
        out: dict[Hashable, int] = {}
        while self.is_open and self._wants:
            worker, remaining = next(iter(self._wants.items()))
            if self.gate.try_start(1) == 0:
                break
            self.held[worker] += 1
            out[worker] = out.get(worker, 0) + 1
            del self._wants[worker]
            if remaining > 1:
                self._wants[worker] = remaining - 1  # to the back of the line
        return list(out.items())

def resumed_admission(resume: dict, *, batch_size: int, policy: StalenessPolicy, max_concurrent: int,
                      total_steps: int, steering: Optional[StalenessSteering] = None) -> Admission:
    """The run's admission; resuming from a learner checkpoint (its arl_state.json), the gate starts at that
    version with the consumed groups accepted."""
    v = int(resume.get("version", 0))
    return Admission(StalenessGate(batch_size=batch_size, policy=policy, max_concurrent=max_concurrent,
                                   max_groups=total_steps * batch_size, version=v,
                                   accepted=int(resume.get("groups_consumed", v * batch_size)) if v else 0),
                     steering=steering)
