"""What a lost role process means for the run's state, as a plan the controller shell carries out. No I/O but the
log: the supervisor decides (restart, go on without it, or stop), this books the decision in the state machines
(admission, weight sync, supervisor) and returns what is left to do: the records, the messages, the respawn.

Booked at once, before the shell awaits anything: the state machines must never see a lost role half restarted.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Union

from arl.controller.admission import Admission, Grant
from arl.controller.supervision import Supervisor
from arl.controller.weight_sync import WeightSync
from arl.transport import messages as m

logger = logging.getLogger("arl.controller")


@dataclasses.dataclass(frozen=True)
class Fatal:
    """The run stops; `note`: why a restart was refused, for the log."""

    note: str = ""


@dataclasses.dataclass(frozen=True)
class RolloutLost:
    """Rollout worker `index` is restarted (restart number `restarts`): its in-flight groups are lost
    (`lost_groups`, their budget returned as `grants`) except `orphans` (the n_traj of groups the learner already
    received: accepted)."""

    index: int
    restarts: int
    lost_groups: int
    orphans: tuple[int, ...]
    grants: list[Grant]
    tell: tuple[m.ControlMessage, ...] = ()  # what every rollout worker is told

    def record(self, reason: str) -> tuple[str, dict[str, Any]]:
        """(fault kind, fields) of the restart record."""
        return "rollout_restart", {"reason": reason[:300], "lost_groups": self.lost_groups}

    def log(self, name: str, reason: str, sup: Supervisor, log_tail: str) -> None:
        logger.warning("%s %s; restarted it (restart %d of at most %d); %d in-flight groups lost, their budget "
                       "returned; last lines of its log:\n%s", name, reason, self.restarts, sup.max_restarts,
                       self.lost_groups, log_tail)


@dataclasses.dataclass(frozen=True)
class InferenceLost:
    """Inference `servers` leave the routing and the weight acks; the run goes on with `remaining`. `restarts` > 0:
    the process is restarted (that restart's number) and its servers rejoin once caught up."""

    servers: list[int]
    remaining: list[int]
    restarts: int = 0
    grants: tuple[Grant, ...] = ()

    @property
    def tell(self) -> tuple[m.ControlMessage, ...]:
        return (m.WorkerLost(role="inference", indices=self.servers),)

    def record(self, reason: str) -> tuple[str, dict[str, Any]]:
        return "inference_restart", {"servers": self.servers}

    def log(self, name: str, reason: str, sup: Supervisor, log_tail: str) -> None:
        logger.warning("inference process %s %s; dropping servers %s, the run goes on with %s; last lines of its "
                       "log:\n%s", name, reason, self.servers, self.remaining, log_tail)
        if self.restarts:
            logger.warning("restarted inference process %s (restart %d of at most %d); servers %s rejoin once they "
                           "loaded the newest weights", name, self.restarts, sup.max_inference_restarts, self.servers)


@dataclasses.dataclass(frozen=True)
class EnvLost:
    """Env server `index` is restarted (restart number `restarts`): its sessions are gone, so the rollout workers
    are told (`worker_lost`): their calls to it fail at once and those groups are dropped with that reason (their
    budget returns with their group_done); new sessions go to the other servers until it is back. `role`
    'judge': a judge worker, the same way (the judge env's calls to it end with the default reward and a reason)."""

    index: int
    restarts: int
    grants: tuple[Grant, ...] = ()
    role: str = "env"

    @property
    def tell(self) -> tuple[m.ControlMessage, ...]:
        return (m.WorkerLost(role=self.role, indices=[self.index]),)

    def record(self, reason: str) -> tuple[str, dict[str, Any]]:
        return f"{self.role}_restart", {"reason": reason[:300], "server": self.index}

    def log(self, name: str, reason: str, sup: Supervisor, log_tail: str) -> None:
        cap, what = ((sup.max_judge_restarts, "judge calls to it end with the default reward") if self.role == "judge"
                     else (sup.max_env_restarts, "its sessions' groups are dropped"))
        logger.warning("%s %s %s; restarted it (restart %d of at most %d); %s; last lines of its log:\n%s",
                       "judge worker" if self.role == "judge" else "env server", name, reason, self.restarts, cap,
                       what, log_tail)


Plan = Union[Fatal, RolloutLost, InferenceLost, EnvLost]


def plan_failure(name: str, *, sup: Supervisor, admission: Admission, weights: WeightSync, registered: bool,
                 spawned: bool, now: float) -> Plan:
    """Process `name` died, went silent or reported a fatal error; `registered`: a role it hosts had registered,
    `spawned`: the launcher started it (so it can start it again)."""
    d = sup.decide(name, registered=registered, lost=weights.lost, rejoining=weights.rejoining, spawned=spawned)
    if d.action == "fatal":
        return Fatal(d.note)
    if d.action == "restart_env":
        role, index = ("env", sup.env_index(name)) if sup.env_index(name) is not None else ("judge",
                                                                                            sup.judge_index(name))
        assert index is not None
        sup.forget((role, index))
        return EnvLost(index, sup.restarting(name, now), role=role)
    if d.action == "restart_rollout":
        index = sup.rollout_index(name)
        assert index is not None
        orphans = tuple(admission.orphans(index))  # pushed, received by the learner, never reported done
        lost, grants = admission.worker_lost(index)
        sup.forget(("rollout", index))
        return RolloutLost(index, sup.restarting(name, now), lost, orphans, grants)
    servers = list(d.servers)
    weights.lose(servers)
    for s in servers:
        sup.forget(("inference", s))
    remaining = sorted(set(range(sup.num_inference)) - weights.lost)
    if not d.restart:
        return InferenceLost(servers, remaining)
    restarts = sup.restarting(name, now)
    weights.restarted(servers)
    return InferenceLost(servers, remaining, restarts)


def give_up(name: str, *, sup: Supervisor, weights: WeightSync) -> list[int]:
    """Restarted inference process `name` did not come back: its servers stay lost; returns them."""
    sup.gave_up(name)
    servers = sup.servers_of(name)
    weights.lose(servers)  # no longer rejoining
    return servers
