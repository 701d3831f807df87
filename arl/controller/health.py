"""The controller's health loop, apart from its message handling: every 0.2 s it looks for role processes that
exited, missed a registration deadline or went silent, and for a run that makes no progress; it carries out what
the supervisor decides about a lost process (`recovery.plan_failure`) or stops the run with the reason, and
brings a restarted server back into the rollout workers' routing (`rejoined`, `weight_actions`).

It holds no socket: what it must send (grants, `worker_lost`, a version that became live) goes through the
`Sends` the controller shell gives it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Optional, Protocol

from arl.controller.admission import Admission, Grant
from arl.controller.diagnosis import describe_stall, investigate_silence, resume_hint
from arl.controller.evaluation import EvalSchedule
from arl.controller.recovery import (EnvLost, Fatal, InferenceLost, JoinFailed, LearnerLost, PolicyLearnerLost,
                                    RolloutLost, give_up, plan_failure, plan_rollback)
from arl.controller.peers import Peers
from arl.controller.reporting import ProgressWatch, Reporter
from arl.controller.supervision import RoleLauncher, Supervisor
from arl.controller.weight_sync import Action, GiveUp, Rejoin, WeightSync
from arl.learner.checkpoint import RESTART_ENV
from arl.transport import messages as m
from arl.utils.proc import tail

logger = logging.getLogger("arl.controller")

Key = tuple[str, int]  # (role, index)


class Sends(Protocol):
    """What the health loop needs the controller shell to send."""

    async def grant(self, grants: list[Grant]) -> None: ...
    async def tell_rollouts(self, msg: m.ControlMessage, index: Optional[int] = None) -> None: ...
    async def advance(self) -> None: ...


class Health:
    def __init__(self, *, run_dir: str, sup: Supervisor, launcher: RoleLauncher, roster: Peers,
                 admission: Admission, weights: WeightSync, schedule: EvalSchedule, reporter: Reporter,
                 progress: ProgressWatch, role_stats: dict[Key, dict], stack_dump_wait: float, sends: Sends,
                 fail: Callable[[str], None]) -> None:
        """`role_stats`: the shell's table of each role's newest heartbeat stats (read, and cleared for a lost
        role); `sends`: the shell; `fail(reason)` stops the run."""
        self.run_dir, self.sup, self.launcher, self.roster = run_dir, sup, launcher, roster
        self.admission, self.weights, self.schedule, self.reporter = admission, weights, schedule, reporter
        self.progress, self.role_stats, self.stack_dump_wait = progress, role_stats, stack_dump_wait
        self.sends, self.fail = sends, fail
        self.names: list[str] = []  # the processes started for the run
        self.learner_lost_for = ""  # why the learner being restarted was lost (for its `learner_restart` record)

    async def watch(self) -> None:
        while await self.check():
            await asyncio.sleep(0.2)

    async def check(self) -> bool:
        """One round of health checks; False once the run failed."""
        for name, code in self.launcher.dead():
            if not await self.on_failure(name, f"exited with code {code}"):
                log = self.launcher.log_path(name)
                self.fail(f"role {name} exited with code {code}{resume_hint(name, self.run_dir)}; last lines of "
                          f"{log}:\n{tail(log, 25)}")
                return False
        now = time.monotonic()
        given_up, failure = self.sup.deadlines(now, self.names, self.roster.has_process)
        if failure:  # restarted roles that did not come back: why, where the launcher knows (waiting for resources)
            failure += "".join(f"; {why}" for why in map(self.launcher.pending, self.sup.late(now)) if why)
        for name in given_up:  # a restarted (or added) process that did not come back: the run goes on without it
            why = self.launcher.pending(name)
            if name in self.sup.joining:
                self.join_failed(name, f"did not register within {self.sup.startup_timeout}s of its start (added "
                                       f"by arl.ctl scale){f'; {why}' if why else ''}")
                continue
            reason = f"did not register within {self.sup.startup_timeout}s of its restart{f'; {why}' if why else ''}"
            give_up(name, sup=self.sup, weights=self.weights)
            self.launcher.kill(name)
            # servers in the run, or coming back
            left = (set(range(self.sup.num_inference)) - self.weights.lost) | self.weights.rejoining
            logger.error("restarted inference process %s %s; %s", name, reason,
                         "the run goes on without it" if left else "no inference server is left")
            self.reporter.event("fault", kind="inference_restart_failed", role=name, reason=reason)
            if not left and not failure:  # nothing would generate again: stop now, with why
                failure = f"no inference server is left: restarted inference process {name} {reason}"
        if failure:
            self.fail(failure)
        if failure or not self.progressing(now):
            return False
        for key, seen in self.sup.silent(time.monotonic()):
            if self.sup.last_seen.get(key) != seen:
                continue  # handled (or heard from again) while an earlier one was investigated
            # name it with what it was waiting on and dump its stacks before it is restarted or the run stops
            why = await investigate_silence(key, time.monotonic() - seen, sup=self.sup, launcher=self.launcher,
                                            role_stats=self.role_stats, reporter=self.reporter,
                                            stack_dump_wait=self.stack_dump_wait)
            if not await self.on_failure(self.sup.process_of(*key), why):
                self.fail(why)
                return False
        return True

    async def learner_settled(self, failed: bool, timeout: float) -> None:
        """Give the learner's heartbeat (1 s) a moment to catch up with the groups accepted so far, so the final
        accounting compares counts taken at (nearly) the same time."""
        deadline = time.monotonic() + timeout
        gate = self.admission.gate
        while time.monotonic() < deadline and not (
                self.reporter.learner_caught_up(self.role_stats.get(("learner", 0), {}), gate.version)
                and (failed or not gate.running)):
            await asyncio.sleep(0.2)

    def progressing(self, now: float) -> bool:
        """False (the run failed, with the reason) when no group gets through (see `Reporter.watch`). Evaluations
        and the time before admission opens do not count as no progress."""
        self.progress.hold(not self.admission.is_open or bool(self.schedule.pending()), now)
        failure = self.reporter.watch(self.progress, now, lambda: describe_stall(
            now, sup=self.sup, admission=self.admission, role_stats=self.role_stats,
            last_messages=self.roster.last_messages))
        if failure is not None:
            self.fail(failure)
        return failure is None

    def join_failed(self, name: str, reason: str) -> None:
        """A process added mid-run (`arl.ctl scale`) did not join (never registered, or exited first, e.g. refused as
        another model): it is not of the run; the run goes on with the fleet it had."""
        self.weights.lose(self.sup.servers_of(name))  # no longer joining
        for role, index in self.sup.gave_up(name):
            self.roster.retire(role, index)
            if role == "rollout":
                self.admission.leave(index)
        self.launcher.kill(name)
        logger.error("%s %s; the run goes on without it", name, reason)
        self.reporter.event("fault", kind="scale_failed", role=name, reason=reason[:500])

    async def on_failure(self, name: str, reason: str) -> bool:
        """Process `name` died, went silent or reported a fatal error: restart it or go on without it, as the
        supervisor decides (`plan_failure` books it); False: the failure is fatal (the caller stops the run)."""
        plan = plan_failure(name, sup=self.sup, admission=self.admission, weights=self.weights,
                            registered=self.roster.has_process(name), spawned=self.launcher.has(name),
                            now=time.monotonic())
        if isinstance(plan, Fatal):
            if plan.note:
                logger.error("%s failed (%s); %s", name, reason, plan.note)
            return False
        if isinstance(plan, JoinFailed):
            self.join_failed(name, f"{reason}; {plan.note}")
            return True
        if isinstance(plan, RolloutLost):  # the new process continues the prompt stream, gets its evaluations
            self.roster.forget(("rollout", plan.index))
            self.reporter.rollout_lost(plan.orphans, plan.lost_groups, self.role_stats.pop(("rollout", plan.index), {}))
        elif isinstance(plan, EnvLost):  # its sessions are gone: the rollout workers drop their groups (or a judge)
            self.roster.forget((plan.role, plan.index))
            self.role_stats.pop((plan.role, plan.index), None)
            self.reporter.event("worker_lost", role=plan.role, process=name, servers=[plan.index], reason=reason)
        elif isinstance(plan, PolicyLearnerLost):  # its successor resumes from its checkpoint (`PolicyLearners`)
            self.roster.forget(("learner", plan.index))
            self.roster.addresses["policy_learners"][plan.index - 1] = None
            self.role_stats.pop(("learner", plan.index), None)
            self.launcher.env[RESTART_ENV] = "1"  # every later start of a learner resumes
            self.learner_lost_for = reason
        elif isinstance(plan, LearnerLost):  # its successor resumes from the newest checkpoint (`learner_back`)
            self.roster.forget(("learner", 0))
            self.roster.addresses["learner"] = None  # a lookup (a restarted rollout worker) waits for the new one
            self.role_stats.pop(("learner", 0), None)
            self.launcher.env[RESTART_ENV] = "1"  # every later start of the learner resumes
            self.learner_lost_for = reason
        else:  # an inference process: out of the routing and the weight acks (killed if it still runs)
            self.launcher.kill(name)
            for s in plan.servers:
                self.role_stats.pop(("inference", s), None)
            self.reporter.event("worker_lost", role="inference", process=name, servers=plan.servers, reason=reason,
                                remaining=plan.remaining)
        plan.log(name, reason, self.sup, tail(self.launcher.log_path(name), 10))
        await self.sends.grant(list(plan.grants))
        for msg in plan.tell:
            await self.sends.tell_rollouts(msg)
        if plan.restarts:  # killed first if it still runs (a hung one); not started if the run ends meanwhile
            record = plan.record(reason)
            if record is not None:
                self.reporter.fault(record[0], "worker_restarted", role=name, **record[1], restarts=plan.restarts)
            self.launcher.kill(name)
            for _ in range(500):
                if not self.launcher.alive(name):
                    break
                await asyncio.sleep(0.02)
            self.launcher.respawn(name)
        if isinstance(plan, InferenceLost):  # a version only it had not acked is live now (the run may end)
            await self.sends.advance()
        return True

    async def learner_back(self, resumed: Optional[dict[str, Any]], address: str,
                           path_of: Callable[[int], str]) -> list[Action]:
        """The restarted learner registered at `address`, resumed from the checkpoint `resumed` says: the run goes
        back to its version (`plan_rollback`), the rollout workers push to the new learner and draw the unsettled
        prompts again, and the weight actions to carry out (every server loads the checkpoint's weights) are
        returned. A state that names no usable checkpoint stops the run."""
        version = resumed.get("version") if isinstance(resumed, dict) else None
        try:
            rb = plan_rollback(resumed if isinstance(resumed, dict) else {}, address=address,
                               path=path_of(version if isinstance(version, int) else 0), admission=self.admission,
                               weights=self.weights, schedule=self.schedule,
                               streams={i: self.roster.streams_of(i) for i in self.sup.rollouts()})
        except ValueError as e:
            self.fail(f"learner restart: {e}")
            return []
        lost = self.reporter.learner_rollback(rb.groups_settled, rb.trajectories_settled)
        for i, msg in rb.tell.items():  # a rollout worker restarted later starts where this one rewinds to
            self.roster.positions.update({int(s): p for s, p in msg.position.items()})
            await self.sends.tell_rollouts(msg, i)
        restarts, cap = self.sup.learner_restarts, self.sup.max_learner_restarts
        self.reporter.fault("learner_restart", reason=self.learner_lost_for[:300], from_version=rb.from_version,
                            to_version=rb.to_version, restarts=restarts, lost_groups=lost)
        line = (f"learner died ({self.learner_lost_for[:200]}); restarted from checkpoint v{rb.to_version} (restart "
                f"{restarts} of at most {cap}); {lost} accepted groups past the checkpoint lost with it "
                f"(lost_learner_restart)")
        logger.warning("%s; running groups holding tokens of versions after v%d are dropped as lost_version", line,
                       rb.to_version)
        self.reporter.say(line)
        return rb.actions

    async def rejoined(self, role: str, index: int, address: str, version: Optional[int] = None) -> None:
        """Restarted (or added) server `role` `index` is back at `address` (with weights `version`): the rollout
        workers route to it (again)."""
        self.reporter.event("worker_back", role=role, server=index, address=address,
                            **({} if version is None else {"version": version}))
        await self.sends.tell_rollouts(m.WorkerBack(role=role, index=index, address=address))

    async def weight_actions(self, actions: list[Action]) -> None:
        """`WeightSync`'s actions besides its sends: a restarted inference server that caught up rejoins; one that
        cannot load weights is handled as the failure of its process (restarted, dropped, or the run stops)."""
        for a in actions:
            if isinstance(a, Rejoin):
                self.sup.heard(("inference", a.server), time.monotonic())
                address = self.roster.addresses["inference"][a.server]
                logger.warning("inference server %d is back (at %s) with version %s", a.server, address, a.version)
                await self.rejoined("inference", a.server, address, a.version)
            elif isinstance(a, GiveUp):
                why = f"could not load weights v{a.version} ({a.attempts} tries in a row): {a.error}"
                if not await self.on_failure(self.sup.process_of("inference", a.server), why):
                    self.fail(f"inference server {a.server} {why}")
