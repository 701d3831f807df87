"""What a lost role process means for the run's state, as a plan the controller shell carries out. No I/O but the
log: the supervisor decides (restart, go on without it, or stop), this books the decision in the state machines
(admission, weight sync, supervisor) and returns what is left to do: the records, the messages, the respawn.

Booked at once, before the shell awaits anything: the state machines must never see a lost role half restarted.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Union

from arl.controller.admission import Admission, Grant
from arl.data.position import DataPosition
from arl.controller.evaluation import EvalSchedule
from arl.controller.supervision import Supervisor, process_role
from arl.controller.weight_sync import Action, WeightSync
from arl.transport import messages as m

logger = logging.getLogger("arl.controller")


@dataclasses.dataclass(frozen=True)
class Fatal:
    """The run stops; `note`: why a restart was refused, for the log."""

    note: str = ""


@dataclasses.dataclass(frozen=True)
class JoinFailed:
    """A process added mid-run (`arl.ctl scale`) failed before it joined: it is given up, the run goes on."""

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


@dataclasses.dataclass(frozen=True)
class LearnerLost:
    """The learner is restarted (restart number `restarts`) from its newest checkpoint; the run had reached
    `from_version`. Admission pauses and the rollout workers hold finished groups until it is back (`Rollback`):
    what they would push now would go to the dead process."""

    restarts: int
    from_version: int
    grants: tuple[Grant, ...] = ()

    @property
    def tell(self) -> tuple[m.ControlMessage, ...]:
        return (m.WorkerLost(role="learner", indices=[0]),)

    def record(self, reason: str) -> Optional[tuple[str, dict[str, Any]]]:
        return None  # written when it is back and the checkpoint's version is known (`Rollback`)

    def log(self, name: str, reason: str, sup: Supervisor, log_tail: str) -> None:
        logger.warning("learner %s at version %d; restarting it from its newest checkpoint (restart %d of at most "
                       "%d); last lines of its log:\n%s", reason, self.from_version, self.restarts,
                       sup.max_learner_restarts, log_tail)


@dataclasses.dataclass(frozen=True)
class PolicyLearnerLost:
    """The learner of trainable listed policy `index` (learner `index` >= 1) is restarted (restart number
    `restarts`) from its own newest checkpoint. Nothing else waits: the run's learner and the other policies go on;
    what the lost process held is lost to that policy alone (`PolicyLearners.learner_back` books it)."""

    index: int
    restarts: int
    grants: tuple[Grant, ...] = ()
    tell: tuple[m.ControlMessage, ...] = ()

    def record(self, reason: str) -> Optional[tuple[str, dict[str, Any]]]:
        return None  # written when it is back and its checkpoint's version is known

    def log(self, name: str, reason: str, sup: Supervisor, log_tail: str) -> None:
        logger.warning("%s %s; restarting it from its newest checkpoint (restart %d of at most %d); last lines of "
                       "its log:\n%s", name, reason, self.restarts, sup.max_learner_restarts, log_tail)


Plan = Union[Fatal, JoinFailed, RolloutLost, InferenceLost, EnvLost, LearnerLost, PolicyLearnerLost]


@dataclasses.dataclass(frozen=True)
class Rollback:
    """The restarted learner is back, resumed from checkpoint `to_version`: the run goes back there from
    `from_version`. `actions`: every inference server loads the checkpoint's weights; `tell`: each rollout worker's
    `LearnerRestarted`; `groups_settled` / `trajectories_settled`: what the checkpoint's learner accounts for (the
    rest of the groups accepted so far are gone with the lost process)."""

    from_version: int
    to_version: int
    groups_settled: int
    trajectories_settled: int
    actions: list[Action]
    tell: dict[int, m.LearnerRestarted]


def _count(state: dict, key: str, default: Optional[int] = None) -> int:
    """Field `key` of a restarted learner's resume state: an int >= 0, else ValueError naming it."""
    value = state.get(key, default)
    if type(value) is not int or value < 0:
        raise ValueError(f"the restarted learner's resume state: {key!r} must be an int >= 0, got {value!r:.40}")
    return value


def plan_rollback(resumed: dict, *, address: str, path: str, admission: Admission, weights: WeightSync,
                  schedule: EvalSchedule, streams: dict[int, list[int]]) -> Rollback:
    """The restarted learner registered at `address` with `resumed` (its `Register.resumed`); `path`: where the
    inference servers find the checkpoint's weights. Books the rollback in the gate, the weight sync and the
    evaluation schedule; ValueError (nothing booked) for a state without a usable field."""
    v = _count(resumed, "version")
    consumed = _count(resumed, "groups_consumed", 0)
    settled, trajs = _count(resumed, "groups_settled", consumed), _count(resumed, "trajectories_settled", 0)
    positions = resumed.get("data_position") or {}
    if not isinstance(positions, dict):
        raise ValueError(f"the restarted learner's resume state: 'data_position' must be a map, got "
                         f"{positions!r:.40}")
    for k, p in positions.items():
        DataPosition.from_state(p)  # ValueError naming what is wrong
    from_version = max(admission.gate.version, weights.newest or 0)
    admission.rollback(v, consumed)
    schedule.rollback(v)
    actions = weights.rollback(v, path)
    # per rollout worker, each stream it draws (`streams`: worker -> stream ids): a stream the checkpoint settled
    # nothing of (none yet, or no checkpoint: v0) is drawn again from its start
    tell = {i: m.LearnerRestarted(address=address, version=m.Count(v),
                                  position={str(s): positions.get(str(s), DataPosition().to_state()) for s in ids})
            for i, ids in streams.items()}
    return Rollback(from_version, v, settled, trajs, actions, tell)


def plan_failure(name: str, *, sup: Supervisor, admission: Admission, weights: WeightSync, registered: bool,
                 spawned: bool, now: float) -> Plan:
    """Process `name` died, went silent or reported a fatal error; `registered`: a role it hosts had registered,
    `spawned`: the launcher started it (so it can start it again)."""
    d = sup.decide(name, registered=registered, lost=weights.lost, rejoining=weights.rejoining, spawned=spawned)
    if d.action == "fatal":
        return Fatal(d.note)
    if d.action == "give_up":
        return JoinFailed(d.note)
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
    if d.action == "restart_policy_learner":
        key = process_role(name)
        assert key is not None
        sup.forget(key)
        return PolicyLearnerLost(key[1], sup.restarting(name, now))
    if d.action == "restart_learner":
        from_version = max(admission.gate.version, weights.newest or 0)
        admission.pause()
        sup.forget(("learner", 0))
        return LearnerLost(sup.restarting(name, now), from_version)
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
