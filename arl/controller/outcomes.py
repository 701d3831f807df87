"""Where a prompt group's end is booked, from whichever message says it first: its rollout worker's `group_done`,
or the learner's receipt (`group_received`) or drop (`groups_dropped`). Each is booked in the gate's budget
(`Admission`), the run's counts (`Reporter`) and the progress watch; the grants it frees are returned for the
controller shell to send. No socket here.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from arl.controller.admission import Admission, Grant
from arl.controller.reporting import ProgressWatch, Reporter
from arl.rollout.staleness import parse_group_id
from arl.transport import messages as m


class GroupOutcomes:
    def __init__(self, admission: Admission, reporter: Reporter, progress: ProgressWatch,
                 refuse: Callable[[str, str], None]) -> None:
        """`refuse(kind, text)` counts a message that names no group of this run (`Refusals`)."""
        self.admission, self.reporter, self.progress, self.refuse = admission, reporter, progress, refuse

    def done(self, worker: int, msg: m.GroupDone) -> Optional[list[Grant]]:
        """Rollout worker `worker` says how its group ended; None: it runs no such group (refused)."""
        try:
            grants = self.admission.group_done(worker, msg.accepted, msg.group_id)
        except ValueError:
            self.refuse("unexpected_group_done", "dropped a group_done for no running group")
            return None
        self.reporter.group_done(msg.accepted, msg.reason, msg.n_traj, msg.traj_stats, msg.n_traj_raw, msg.traces)
        if msg.accepted:
            self.progress.accepted(time.monotonic())
        else:
            # a lost policy's groups after a learner restart are no sign of a run that cannot progress
            self.progress.dropped(str(msg.reason), time.monotonic(), error=msg.error,
                                  streak=msg.reason != "lost_version")
        return grants

    def dropped(self, msg: m.GroupsDropped) -> list[Grant]:
        """The learner dropped groups (stale, invalid): their budget comes back."""
        # settled first: a drop must not overtake its group's acceptance; one of no group of this run has no budget
        n = msg.n - sum(not self.received(gid, 0) for gid in msg.group_ids or [])
        if n <= 0:
            return []
        self.reporter.group_reasons["dropped_" + msg.reason] += n
        self.progress.dropped("learner_" + msg.reason, time.monotonic(), n, streak=False)
        return self.admission.groups_dropped(n)

    def received(self, group_id: str, n_traj: int) -> bool:
        """The learner has group `group_id`: it is accepted whatever its rollout worker does next (see
        `Admission.received`); False if no rollout worker of this run holds or held it."""
        who = parse_group_id(group_id)
        outcome = "unknown" if who is None else self.admission.received(who[0], who[1], group_id, n_traj)
        if outcome == "unknown":
            self.refuse("unknown_group", f"the learner reports group {group_id[:60]!r}, which no rollout worker holds")
        elif outcome == "reclaimed":  # its worker died after pushing it: counted lost, now accepted
            self.reporter.groups_lost(-1)
            self.reporter.group_done(True, "accepted", n_traj, None, None)
            self.progress.accepted(time.monotonic())
        return outcome != "unknown"
