"""Servers and rollout workers join and leave a running run: `python -m arl.ctl <run_dir> scale inference=+2` (or
`=-1`, and `rollout=+1` / `rollout=-1`).

Why through the controller: it owns who is in the run. A joining server is what a restarted one is to the rest
of the run: its process starts, registers, is sent the newest weights, and only once it has loaded them do the
rollout workers route to it (`WeightSync.add_server`, then the usual `Rejoin` -> `worker_back`, which a rollout
worker's client takes for a new index too). A leaving server is drained: the rollout workers send it nothing new
(`worker_draining`), it leaves the weight acks at once (the run never waits for its loads again), and once its
heartbeats say nothing is in flight (or `inference.drain_timeout_s` passed) it is stopped and the rollout workers
hear `worker_lost`, which re-sends whatever it had not answered: nothing accepted is lost. Indices are never
reused: a server that left stays out (`Addresses.retired`, so a rollout worker restarted later does not route to
it).

A joining rollout worker is a new process of a new index with a prompt stream of its own (`arl.rollout.prompts`:
every row, its own order); it asks the gate for groups like the others. A leaving one is drained: the gate forgets
what it asked for (`Admission.leave`), it asks for nothing more (`Drain`) and finishes its running groups (pushed,
accepted, as any other), and once its heartbeat says it drains with nothing running (or `rollout.drain_timeout_s`
passed: those groups are lost, their budget returned) it is stopped and a worker that stays adopts its prompt
streams (`AdoptStreams`, from the positions of its last heartbeat): what it had not finished is drawn again there,
and the streams go on, so a resume or a learner rollback later draws them exactly. Rollout worker 0 runs the
evaluations and never leaves.

Authentication: a `scale` comes from outside the run, so it is accepted from any peer that has the run's control
key (`run_dir/control.json`, readable by its owner only, written when the controller binds) and, on a run with a
shared secret, only over frames signed with it. What is refused (a wrong key, an unknown role, no server left, a
launcher or weight transport that cannot add servers) is answered with the reason and changes nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import sys
import time
from typing import Any, Callable, Optional

from arl.controller.autoscale import Autoscaler, AutoscalePolicy
from arl.transport import messages as m

logger = logging.getLogger("arl.controller")

CONTROL_FILE = "control.json"


class ScaleRefused(ValueError):
    """A scale request that changes nothing, with the reason the caller is told."""


def write_control_file(run_dir: str, address: str, signed: bool, secret: Optional[str] = None) -> str:
    """run_dir/control.json (mode 0600): where the controller listens and the key `arl.ctl` must show; the key.
    `secret`: the run's shared secret when the run made it itself (Ray), so that `arl.ctl` on this machine, as
    this user, can sign its frames; a secret the user gave is never written (they have it)."""
    key = secrets.token_hex(16)
    path = os.path.join(run_dir, CONTROL_FILE)
    fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"controller": address, "key": key, "signed": signed, "pid": os.getpid(),
                   **({"secret": secret} if secret else {})}, f)
    os.replace(path + ".tmp", path)
    return key


class Scaling:
    """The controller's `scale` handler. `ctl`: the controller shell (its pieces and its sends)."""

    def __init__(self, ctl: Any, *, signed: bool = False, key: Optional[str] = None, drain_timeout_s: float = 60.0,
                 python: str = sys.executable, autoscale: Optional[AutoscalePolicy] = None,
                 rollout_drain_timeout_s: float = 120.0, rollout_refusal: str = "",
                 env_drain_timeout_s: float = 60.0, made_secret: Optional[str] = None) -> None:
        """Writes run_dir/control.json (`write_control_file`: `signed`, `made_secret`) unless given its `key`.
        `autoscale`: scale by rule (`arl.controller.autoscale`); its loop starts with the controller's.
        `rollout_refusal`: why this run's rollout workers cannot be added ('' : they can)."""
        if key is None:
            key = write_control_file(ctl.run_dir, ctl.address, signed=signed, secret=made_secret)
        self.ctl, self.key, self.drain_timeout_s, self.python = ctl, key, drain_timeout_s, python
        self.rollout_drain_timeout_s, self.rollout_refusal = rollout_drain_timeout_s, rollout_refusal
        self.env_drain_timeout_s = env_drain_timeout_s
        self._busy = False  # one scale at a time
        self._tasks: set[asyncio.Task] = set()
        self.handlers = {"scale": self.on_scale, "leaving": self.on_leaving}
        self.autoscaler = Autoscaler(autoscale) if autoscale is not None else None
        if self.autoscaler is not None:
            self._spawn(self.watch())

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def on_leaving(self, ident: bytes, msg: m.Leaving) -> None:
        """An inference process or a rollout worker got a preemption notice: drain it as a scale-down would (it
        stops by itself after its grace period if the drain takes longer)."""
        role, index = self.ctl.roster.who[ident]
        name = self.ctl.sup.process_of(role, index)
        if role == "rollout":
            if index == 0:  # it runs the evaluations: it is restarted once it stops, as after any exit
                logger.warning("rollout0 got a preemption notice: it runs the evaluations, so it is restarted "
                               "when it stops, not drained")
                return
            logger.warning("%s got a preemption notice (grace %.0fs): draining it", name, msg.grace_s)
            self.ctl.reporter.event("preempted", role=name, grace_s=msg.grace_s)
            grace = min(self.rollout_drain_timeout_s, max(0.0, float(msg.grace_s)))
            self._spawn(self._remove_rollouts([index], grace))
            return
        servers = [s for s in self.ctl.sup.servers_of(name) if s not in self.ctl.weights.lost]
        if role != "inference" or not servers:
            return
        logger.warning("%s got a preemption notice (grace %.0fs): draining servers %s", name, msg.grace_s, servers)
        self.ctl.reporter.event("preempted", role=name, servers=servers, grace_s=msg.grace_s)
        self._spawn(self._remove(servers, min(self.drain_timeout_s, max(0.0, float(msg.grace_s)))))

    async def on_scale(self, ident: bytes, msg: m.Scale) -> None:
        """Check the request now; carry it out in a task (a drain takes seconds: the controller goes on)."""
        try:
            if not secrets.compare_digest(str(msg.token), self.key):
                raise ScaleRefused("wrong control key (run_dir/control.json of this run)")
            if self._busy:
                raise ScaleRefused("another scale of this run is under way")
            plan = self._plan(msg.changes)
        except ScaleRefused as e:
            logger.warning("scale refused: %s", e)
            return await self._reply(ident, m.Scaled(ok=False, message=str(e)))
        self._busy = True
        self._spawn(self._carry_out(ident, plan))

    async def _reply(self, ident: bytes, msg: m.Scaled) -> None:
        await self.ctl.router.send(ident, msg.TYPE, msg.to_payload())

    def _plan(self, changes: Any) -> dict[str, int]:
        if not isinstance(changes, dict) or not changes:
            raise ScaleRefused("nothing to scale: give role=+n or role=-n")
        plan: dict[str, int] = {}
        for role, n in changes.items():
            if role not in ("inference", "rollout", "env"):
                raise ScaleRefused(f"cannot scale {role!r}: inference servers, rollout workers and env servers join "
                                   "and leave a running run (inference=, rollout=, env=)")
            if not isinstance(n, int) or isinstance(n, bool) or n == 0:
                raise ScaleRefused(f"{role}={n!r}: give a non-zero whole number (+2, -1)")
            plan[role] = n
        if any(n > 0 for n in plan.values()):
            if not getattr(self.ctl.launcher, "elastic", False):
                raise ScaleRefused(f"the {type(self.ctl.launcher).__name__} cannot start roles mid-run yet "
                                   "(the local launcher can)")
        sup = self.ctl.sup
        if plan.get("rollout", 0) > 0 and self.rollout_refusal:
            raise ScaleRefused(f"rollout workers cannot join this run: {self.rollout_refusal}")
        if "env" in plan and not sup.num_env:
            raise ScaleRefused("this run has no env servers: its envs run inside the rollout workers (start it with "
                               "env.servers=N to scale them)")
        if "inference" in plan and sup.servers_per_process != 1:
            raise ScaleRefused("scaling inference servers needs inference.servers_per_process=1 (one per process)")
        if plan.get("inference", 0) > 0 and not getattr(self.ctl.weights_link, "elastic", False):
            raise ScaleRefused("this run's weight transport cannot add servers after the learner started "
                               "(weights.transport=disk can)")
        for role, n in plan.items():
            live, _, _, _, what = self._roles()[role]
            if len(live()) + n < 1:
                raise ScaleRefused(f"{role}={n} would leave {len(live()) + n} {what}: a run needs at least one (now: "
                                   f"{live()})")
            first = getattr(sup, sup.COUNTS[role])
            for index in range(first, first + max(0, n)):  # beyond what the launcher could ever place (Ray)
                why = self.ctl.launcher.fits(role, index)
                if why:
                    raise ScaleRefused(why)
        return plan

    async def _carry_out(self, ident: bytes, plan: dict[str, int]) -> None:
        try:
            lines, extra = [], {}
            for role, n in plan.items():
                live, remove, drain_s, key, what = self._roles()[role]
                # the newest go (never rollout0: it runs the evaluations, and the newest go first)
                done = await (self._add(role, n) if n > 0 else remove(live()[n:], drain_s))
                now = extra[key] = live()
                lines.append(f"{role} {n:+d}: {done}; {what} now: {now}")
                self.ctl.reporter.event("scale", role=role, change=n, servers=now, done=done)
            text = "; ".join(lines)
            logger.warning("scale: %s", text)
            await self._reply(ident, m.Scaled(ok=True, message=text, extra=extra))
        except Exception as e:  # noqa: BLE001 - the run goes on; the caller hears why
            logger.exception("scale failed")
            await self._reply(ident, m.Scaled(ok=False, message=f"scale failed: {type(e).__name__}: {e}"))
        finally:
            self._busy = False

    def _roles(self) -> dict[str, tuple[Callable[[], list[int]], Callable[..., Any], float, str, str]]:
        """Per role: (its live indices, how one leaves, its drain timeout, the answer's key, its name)."""
        sup = self.ctl.sup
        return {"inference": (self.ctl.weights.alive, self._remove, self.drain_timeout_s, "serving",
                              "servers serving"),
                "rollout": (sup.rollouts, self._remove_rollouts, self.rollout_drain_timeout_s, "rollout",
                            "rollout workers"),
                "env": (lambda: sup.live("env"), self._remove_envs, self.env_drain_timeout_s, "env", "env servers")}

    ADDED = {"inference": "servers {} (they take requests once they loaded the newest weights)",
             "rollout": "rollout workers {} (each draws a prompt stream of its own)",
             "env": "env servers {} (sessions go there once they registered)"}

    async def _add(self, role: str, n: int) -> str:
        """Start `n` new processes of `role` (new indices, never reused), each booked in the run's shape first."""
        ctl, sup = self.ctl, self.ctl.sup
        count = sup.COUNTS[role]
        added = []
        for _ in range(n):
            index = getattr(sup, count)
            if role == "inference":  # out of the weight acks and the routing until it loaded the newest weights
                ctl.weights.add_server()
            setattr(sup, count, index + 1)
            ctl.roster.limits[role] += 1
            if isinstance(ctl.roster.addresses.get(role), list):  # where it listens, once it registered
                ctl.roster.addresses[role].append(None)
            self._start(role, index)
            added.append(index)
        return "started " + self.ADDED[role].format(added)

    async def _remove(self, leaving: list[int], drain_s: float) -> str:
        """Drain `leaving` (at most `drain_s` seconds), then stop their processes."""
        ctl = self.ctl
        t0 = time.monotonic()
        for s in leaving:
            ctl.roster.retire("inference", s)
            ctl.weights.lose([s])  # out of the weight acks now: a version goes live without it
            await ctl.tell_rollouts(m.WorkerDraining(role="inference", index=s))
        await ctl.advance()
        left = await self._drained("inference", leaving, t0, drain_s, lambda st: int(st.get("inflight", 0)))
        for s in leaving:
            self._stop("inference", s)
        await ctl.tell_rollouts(m.WorkerLost(role="inference", indices=leaving))  # re-sends what they still had
        ctl.roster.write(ctl.address)
        late = f"; {left} requests not finished within {drain_s:g}s were re-sent" if left else ""
        return f"drained and stopped servers {leaving} in {time.monotonic() - t0:.1f}s{late}"

    def _stop(self, role: str, index: int) -> dict:
        """Stop the process of `role` `index` that left (an expected exit; its resources go back) and forget it;
        returns its last heartbeat's stats."""
        ctl = self.ctl
        ctl.launcher.remove(ctl.sup.process_of(role, index))
        ctl.sup.forget((role, index))
        ctl.roster.forget((role, index))
        return ctl.role_stats.pop((role, index), {})

    def _start(self, role: str, index: int) -> str:
        """Start the process of a new `role` `index`; it must register within startup_timeout, as a restart."""
        ctl, sup = self.ctl, self.ctl.sup
        name = sup.process_of(role, index)
        argv = sup.command(self.python, ctl.run_dir, ctl.address, role, index)
        sup.restarted_at[name] = time.monotonic()
        sup.joining.add(name)  # not registered within startup_timeout: given up, the run goes on without it
        ctl.launcher.add(name, argv, os.path.join(ctl.run_dir, "logs", f"{name}.log"))
        ctl.health.names.append(name)
        return name

    async def _remove_envs(self, leaving: list[int], drain_s: float) -> str:
        """Drain env servers `leaving` (no new session; open ones end, at most `drain_s` seconds), then stop them;
        a session still open then is gone with its server (its group is dropped, counted, as for a lost one)."""
        ctl = self.ctl
        t0 = time.monotonic()
        for s in leaving:
            ctl.roster.retire("env", s)
            await ctl.tell_rollouts(m.WorkerDraining(role="env", index=s))
        left = await self._drained("env", leaving, t0, drain_s, lambda st: int(st.get("sessions", 0)))
        served = {s: int(self._stop("env", s).get("sessions_opened", 0)) for s in leaving}
        await ctl.tell_rollouts(m.WorkerLost(role="env", indices=leaving))
        ctl.roster.write(ctl.address)
        late = f"; {left} sessions still open after {drain_s:g}s were closed with it" if left else ""
        return (f"drained and stopped env servers {leaving} in {time.monotonic() - t0:.1f}s (sessions they had "
                f"opened: {served}){late}")

    async def _remove_rollouts(self, leaving: list[int], drain_s: float) -> str:
        """Drain rollout workers `leaving` (their running groups finish, at most `drain_s` seconds), stop them,
        and hand their prompt streams to the worker that stays with the fewest."""
        ctl, sup = self.ctl, self.ctl.sup
        leaving = [i for i in leaving if i != 0 and i not in sup.retired["rollout"]]
        t0 = time.monotonic()
        for i in leaving:
            ctl.admission.leave(i)
            await ctl.tell_rollouts(m.Drain(), i)
        left = await self._drained("rollout", leaving, t0, drain_s,  # running groups, once it said it drains
                                   lambda st: int(st.get("running", 0)) if st.get("draining") else 1)
        handed: dict[int, list[int]] = {}
        accepted: dict[int, int] = {}
        for i in leaving:
            ctl.roster.retire("rollout", i)
            last = self._stop("rollout", i)
            orphans = ctl.admission.orphans(i)  # pushed and received, group_done never came: accepted
            lost, grants = ctl.admission.worker_lost(i)  # past the drain timeout: lost in flight
            accepted[i] = int(last.get("groups_accepted", 0))
            ctl.reporter.rollout_lost(orphans, lost, last)
            await ctl.grant(grants)
            streams = ctl.roster.streams_of(i)
            stays = [w for w in sup.rollouts() if w not in leaving]
            to = min(stays, key=lambda w: (len(ctl.roster.streams_of(w)), w))
            await ctl.tell_rollouts(m.AdoptStreams(streams=ctl.roster.adopt(streams, to)), to)
            handed.setdefault(to, []).extend(streams)
        ctl.roster.write(ctl.address)
        late = f"; {left} groups not finished within {drain_s:g}s were lost (their prompts drawn again)" if left else ""
        moved = ", ".join(f"streams {s} to rollout{w}" for w, s in sorted(handed.items()))
        return (f"drained and stopped rollout workers {leaving} in {time.monotonic() - t0:.1f}s (groups accepted "
                f"there: {accepted}; {moved}){late}")

    async def _drained(self, role: str, indices: list[int], since: float, drain_s: float,
                       busy: Callable[[dict], int]) -> int:
        """Wait until the heartbeat of each of `role`'s `indices` sent after the drain began says it is idle
        (`busy(stats)`: what it still has: requests in flight, groups running, sessions open), or `drain_s` passed;
        returns what they still had then."""
        deadline = since + drain_s
        while True:
            left = 0
            for i in indices:
                if self.ctl.sup.last_seen.get((role, i), 0.0) > since:
                    left += busy(self.ctl.role_stats.get((role, i), {}))
                elif self.ctl.launcher.alive(self.ctl.sup.process_of(role, i)):
                    left += 1  # not heard from since the drain began: unknown, wait for its next heartbeat
            if left == 0 or time.monotonic() >= deadline:
                return left
            await asyncio.sleep(0.2)

    # -- scaling by rule -------------------------------------------------------------------------------------
    async def watch(self, sample_s: float = 0.5) -> None:
        """`inference.autoscale`: sample the gate, and at each interval let the `Autoscaler` decide."""
        ctl, auto = self.ctl, self.autoscaler
        assert auto is not None
        while not ctl._done.is_set():
            await asyncio.sleep(sample_s)
            if not ctl.admission.is_open or self._busy:
                continue
            auto.sample(ctl.admission.waiting() > 0)
            learner = ctl.role_stats.get(("learner", 0), {})
            serving = ctl.weights.alive()
            joining = len(ctl.weights.rejoining)
            d = auto.decide(time.monotonic(), learner_idle_s=float(learner.get("idle_seconds", 0.0)),
                            learner_train_s=float(learner.get("train_seconds", 0.0)), serving=len(serving),
                            joining=joining)
            if d is None:
                continue
            self._busy = True
            try:
                done = await (self._add("inference", 1) if d.change > 0 else
                              self._remove(serving[-1:], self.drain_timeout_s))
            except Exception:  # noqa: BLE001 - a failed change: the run goes on with the fleet it has
                logger.exception("autoscale %+d failed", d.change)
                continue
            finally:
                self._busy = False
            line = f"autoscale {d.change:+d} ({d.reason}): {done}"
            ctl.reporter.event("autoscale", change=d.change, reason=d.reason, learner_idle=d.learner_idle,
                               gate_blocked=d.gate_blocked, servers=ctl.weights.alive(),
                               joining=sorted(ctl.weights.rejoining))
            ctl.reporter.say(line)
