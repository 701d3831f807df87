"""The controller: starts every role as a process, owns the policy version and the staleness gate, watches health.

It is a thin I/O shell: it maps each control message to calls on pure state machines (`Admission`: the staleness
gate, its waiting rollout workers and, with `max_head_offpolicyness=auto`, the eta it steers to; `WeightSync`: which
server has which policy version; `Supervisor`: heartbeats, deadlines, restart policy; `EvalSchedule`: which versions
are evaluated, when the run is done; `Reporter`: records and accounting), helped by `Peers` (router identities,
addresses) and `GroupOutcomes` (where a group's end is booked), and maps their actions to sends. The weight
transport's controller side (`arl.weights.strategy`) says which messages move weights; `Health` (`health.py`) is
the watch loop that finds lost, late or silent processes and a run without progress, carries out what the
supervisor decides and brings restarted servers back into the routing; `Scaling` adds and drains servers on
`arl.ctl scale`. Control traffic is request/response over one ROUTER socket (the roles hold DEALERs), each message
parsed into its typed form (`arl.transport.messages`), commands sent to a role's ROUTER identity.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from typing import Any, Awaitable, Callable, Optional

from arl.transport import messages as m
from arl.controller.admission import Grant, resumed_admission
from arl.controller.evaluation import EvalSchedule
from arl.controller.health import Health
from arl.controller.outcomes import GroupOutcomes
from arl.controller.peers import Peers, Refusals
from arl.controller.policy_learners import PolicyLearners
from arl.controller.reporting import JsonlSink, MetricsSink, ProgressWatch, Reporter
from arl.controller.scaling import Scaling
from arl.transport.security import advertised_address
from arl.controller.steering import StalenessSteering
from arl.controller.supervision import RoleLauncher, Supervisor
from arl.controller.weight_sync import Action, Send, WeightSync
from arl.report.page import ReportBuilder
from arl.report.traces import TraceWriter
from arl.api.staleness import StalenessPolicy
from arl.rollout.staleness import StalenessGate
from arl.transport.sockets import Router, bind_random
from arl.weights.strategy import WeightsSettings, make_transport

logger = logging.getLogger("arl.controller")

Key = tuple[str, int]  # (role, index)


class RunFailed(RuntimeError):
    pass


class Controller:
    def __init__(self, *, run_dir: str, supervisor: Supervisor, launcher: RoleLauncher, batch_size: int,
                 staleness: StalenessPolicy, max_concurrent_rollouts: int, total_train_steps: int, eval_every: int,
                 eval_max_prompts: int, progress: bool = True, resume: Optional[dict] = None, learner_ranks: int = 1,
                 secret: Optional[bytes] = None, bind_host: str = "127.0.0.1", max_bytes: Optional[int] = None,
                 stack_dump_wait: float = 2.0, sinks: Optional[list[MetricsSink]] = None,
                 max_no_progress_s: float = 0.0, max_consecutive_drops: int = 0, steering: Optional[StalenessSteering]
                 = None, weights_settings: Optional[WeightsSettings] = None, scaling: Optional[dict] = None,
                 fingerprint: Optional[dict] = None, trained_policies: Optional[dict] = None) -> None:
        """`supervisor` holds the run's shape (servers, rollout workers) and its restart and timeout policy.
        `weights_settings` name the transport of weights (default: disk); its controller side says what to send when
        a role registers and turns `WeightSync`'s sends into messages (`arl.weights.strategy`). `fingerprint`: Peers."""
        self.run_dir, self.sup, self.launcher, self.eval_max_prompts = run_dir, supervisor, launcher, eval_max_prompts
        self.learner_ranks = max(1, int(learner_ranks))  # > 1: the learner role runs under torchrun
        # resuming from a learner checkpoint: its version, and each rollout worker's prompt stream position
        resume = dict(resume or {})
        self.start_version = v = int(resume.get("version", 0))
        self.admission = resumed_admission(resume, batch_size=batch_size, policy=staleness, steering=steering,
                                           max_concurrent=max_concurrent_rollouts, total_steps=total_train_steps)
        positions = {int(k): p for k, p in dict(resume.get("data_position", {})).items()}
        self.roster = Peers.of(supervisor, path=os.path.join(run_dir, "addresses.json"), prompt_positions=positions,
                               fingerprint=fingerprint)
        self.peers: dict[Key, bytes] = self.roster.peers  # (role, index) -> router identity (the same dict)
        self.schedule = EvalSchedule(total_steps=total_train_steps, every=eval_every, start_version=v)
        self.weights = WeightSync(supervisor.num_inference)
        # `trained_policies`: the trainable listed policies -> their servers ([]: all), each trained by a learner
        # of its own (1, 2, ..)
        self.policies = PolicyLearners(self, dict(trained_policies or {}), total_train_steps)
        self.reporter = Reporter([JsonlSink(os.path.join(run_dir, "metrics.jsonl")), *(sinks or [])],
                                 total_steps=total_train_steps, progress=progress, page=ReportBuilder(run_dir),
                                 traces=TraceWriter(os.path.join(run_dir, "traces.jsonl")))
        # no silent spinning: drops by reason on the console, a warning when no step happens, a stop when no
        # group gets through (see ProgressWatch)
        self.progress_watch = ProgressWatch(max_no_progress_s=max_no_progress_s,
                                            max_consecutive_drops=max_consecutive_drops, warn_after_s=None)
        self.weights_link = make_transport(weights_settings or WeightsSettings()).controller(
            weights_dir=os.path.join(run_dir, "weights"), num_servers=supervisor.num_inference, secret=secret)
        self._secret, self._bind_host, self._max_bytes, self._scaling = secret, bind_host, max_bytes, scaling
        self.router: Optional[Router] = None
        self.address = ""
        self.role_stats: dict[Key, dict] = {}  # each role's latest heartbeat stats
        self._lookups: list[bytes] = []
        self._done = asyncio.Event()
        self._failure: Optional[str] = None
        self.refuse, self._asked_to_exit = Refusals(), False
        self.control_errors = self.refuse.counts
        self.outcomes = GroupOutcomes(self.admission, self.reporter, self.progress_watch, self.refuse)
        self.health = Health(run_dir=run_dir, sup=supervisor, launcher=launcher, roster=self.roster,
                             admission=self.admission, weights=self.weights, schedule=self.schedule,
                             reporter=self.reporter, progress=self.progress_watch, role_stats=self.role_stats,
                             stack_dump_wait=stack_dump_wait, sends=self, fail=self.fail)
        self._handlers: dict[str, Callable[[bytes, Any], Awaitable[None]]] = {t: getattr(self, f"_on_{t}") for t in (
            "register", "lookup", "heartbeat", "gate_acquire", "group_done", "groups_dropped", "group_received",
            "weights_published", "weights_loaded", "eval_done", "error")}

    # -- views for the launcher, scripts and tests --------------------------------------------------------------
    @property
    def gate(self) -> StalenessGate:
        return self.admission.gate

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def bind(self) -> str:
        self.router = Router(secret=self._secret, **({"max_bytes": self._max_bytes} if self._max_bytes else {}))
        self.address = advertised_address(bind_random(self.router, self._bind_host))
        self.roster.write(self.address)
        # scale, leaving; it writes run_dir/control.json for `arl.ctl`
        self._handlers.update(Scaling(self, signed=self._secret is not None, **(self._scaling or {})).handlers)
        return self.address

    def spawn_roles(self, python: str = sys.executable) -> None:
        for name, argv in self.sup.commands(python, self.run_dir, self.address, self.learner_ranks,
                                            torchrun=not self.launcher.runs_ranks):
            self.launcher.spawn(name, argv, os.path.join(self.run_dir, "logs", f"{name}.log"))
            self.health.names.append(name)

    async def run(self) -> dict:
        """Run until the learner finished `total_train_steps` and the final evaluation is in."""
        tasks = [asyncio.create_task(self._serve()), asyncio.create_task(self.health.watch())]
        try:
            await self._done.wait()
            await self.health.learner_settled(self._failure is not None, 3.5 if self._failure is None else 2.0)
            await self.policies.finished(60.0 if self._failure is None else 0.0)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._ask_roles_to_exit()  # they wind down while the report is drawn (seconds, under load)
            self.reporter.write({"type": "summary", **self.accounting()})
            self.reporter.final_report()
        if self._failure:
            raise RunFailed(self._failure)
        return self.reporter.summary(run_dir=self.run_dir, steps=self.gate.version, lost_inference=self.weights.lost,
                                     learner_restarts=self.sup.learner_restarts)

    async def shutdown(self, grace: float = 5.0) -> None:
        """Ask every role to exit, then make sure it did."""
        await self._ask_roles_to_exit()
        if not await asyncio.to_thread(self.launcher.wait_all, grace):
            await asyncio.to_thread(self.launcher.terminate_all, 3.0)
        if self.router is not None:
            self.router.close()
        self.reporter.close()

    async def _ask_roles_to_exit(self) -> None:
        self.launcher.expect_exit()
        if self.router is None or self._asked_to_exit:
            return
        self._asked_to_exit = True
        for ident in list(self.peers.values()):
            with contextlib.suppress(Exception):
                await self._send(ident, m.Shutdown(reason="run finished"))

    def fail(self, message: str) -> None:
        self._failure = self._failure or message
        self._done.set()

    def accounting(self) -> dict:
        transport = {"controller": dict(self.router.stats) if self.router is not None else {},
                     "controller_refused": dict(self.control_errors)}
        return {**self.reporter.accounting(
            role_stats=self.role_stats, steps=self.gate.version, running_groups=self.gate.running,
            failure=self._failure, rollout_restarts=self.sup.restarts, inference_restarts=self.sup.inference_restarts,
            transport=transport, env_restarts=self.sup.env_restarts, learner_restarts=self.sup.learner_restarts),
            **self.policies.accounting()}  # and each trainable listed policy's own books

    # -- message handling --------------------------------------------------------------------------------------
    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            ident, msg_type, payload = await self.router.recv()
            try:
                await self._dispatch(ident, msg_type, payload)
            except Exception as e:  # noqa: BLE001 - a bad control message must not kill the controller
                self.refuse("bad_payload", f"error handling {msg_type}: {type(e).__name__}: {e}",
                            exc_info=not self.control_errors.get("bad_payload"))

    async def _dispatch(self, ident: bytes, msg_type: str, payload: Any) -> None:
        """Only registered roles may talk to the controller, except to `register`/`lookup`, and some messages only
        one role (`Peers`). Everything else is dropped and counted, never acted on."""
        refused = self.roster.unknown_peer(ident, msg_type, payload)
        if refused is not None:
            return self.refuse(*refused)
        handler = self._handlers.get(msg_type)
        if handler is None:
            return logger.warning("controller: unexpected message type %s", msg_type)
        try:
            msg = m.parse(msg_type, payload)
        except ValueError as e:
            return self.refuse("bad_register" if msg_type == "register" else "bad_payload", f"refused {msg_type}: {e}")
        refused = self.roster.wrong_sender(ident, msg_type)
        if refused is None:  # what a trainable listed policy's learner says, and its weights, go to `policies`
            await (self.policies.route(self.roster.who.get(ident), msg) or handler(ident, msg))
        else:
            self.refuse(*refused)
        self.roster.heard_from(ident, msg_type, time.monotonic())

    async def _send(self, ident: bytes, msg: m.ControlMessage) -> None:
        assert self.router is not None
        await self.router.send(ident, msg.TYPE, msg.to_payload())

    async def _send_to(self, key: Key, msg: m.ControlMessage) -> None:
        """Send to role `key` if it is registered (else it is being restarted, or gone)."""
        ident = self.peers.get(key)
        if ident is not None:
            await self._send(ident, msg)

    async def _on_register(self, ident: bytes, msg: m.Register) -> None:
        refused = self.roster.register(ident, msg.role, msg.index, msg.address, self.sup.last_seen, msg.fingerprint)
        if refused is not None:
            if refused[0] == "not_this_run":  # another model or config: it is told why (it exits, naming it)
                await self._send(ident, m.Ack(ok=False, message=refused[1]))
            return self.refuse(*refused)
        key = (msg.role, msg.index)
        restarted = self.sup.registered(key, time.monotonic(), len(self.peers))
        logger.info("registered %s%d (pid %s)", msg.role, msg.index, msg.pid)
        placed = self.launcher.where(self.sup.process_of(*key))  # {} where there is nothing to say (one host)
        if placed:
            self.reporter.event("role_placed", role=f"{msg.role}{msg.index}", process=self.sup.process_of(*key),
                                **placed)
        self.roster.write(self.address)
        await self._send(ident, m.Ack(ok=True, prompt_position=self.roster.prompt_position(msg.role, msg.index)))
        await self._send_all(self.weights_link.on_register(msg, self.peers.__contains__))  # e.g. a weight group
        if msg.role == "inference":
            await self._apply(self.weights.registered(msg.index))  # a restarted server catches up, then rejoins
        await self.policies.registered(msg, restarted)  # a server gets each policy's newest; a policy learner back
        if msg.role in ("env", "judge") and restarted and msg.address:  # the rollout workers route to it again
            await self.health.rejoined(msg.role, msg.index, msg.address)
        if key == ("learner", 0) and restarted:  # back from its newest checkpoint: the run rolls back to it
            await self._apply(await self.health.learner_back(msg.resumed, msg.address or "",
                                                             self.weights_link.resume_path))
        await self._answer_lookups()
        await self._maybe_start()
        if restarted and key == ("rollout", 0):  # evaluations it was running died with it: ask again
            await self._evaluate(self.schedule.pending())

    async def _on_lookup(self, ident: bytes, msg: m.Lookup) -> None:
        self._lookups.append(ident)
        await self._answer_lookups()

    async def _answer_lookups(self) -> None:  # where the learners and every server listen, once all of them said
        while self.roster.complete() and self._lookups:
            await self._send(self._lookups.pop(), m.Addresses(**self.roster.addresses))

    async def _on_heartbeat(self, ident: bytes, msg: m.Heartbeat) -> None:
        self.sup.heard((msg.role, msg.index), time.monotonic())
        self.role_stats[(msg.role, msg.index)] = msg.stats
        if msg.role == "rollout":
            self.roster.note_position(msg.index, msg.stats.get("prompt_position"))

    async def _on_gate_acquire(self, ident: bytes, msg: m.GateAcquire) -> None:
        await self.grant(self.admission.acquire(self.roster.who[ident][1], msg.want, msg.incarnation))

    async def _on_group_done(self, ident: bytes, msg: m.GroupDone) -> None:
        await self.grant(self.outcomes.done(self.roster.who[ident][1], msg) or [])

    async def _on_groups_dropped(self, ident: bytes, msg: m.GroupsDropped) -> None:
        await self.grant(self.outcomes.dropped(msg))

    async def _on_group_received(self, ident: bytes, msg: m.GroupReceived) -> None:
        self.outcomes.received(msg.group_id, msg.n_traj)

    async def _on_weights_published(self, ident: bytes, msg: m.WeightsPublished) -> None:
        self.progress_watch.stepped(time.monotonic())
        await self._apply(self.weights.publish(msg.version, msg.path))
        self.reporter.train(msg.version, msg.metrics, self.role_stats, admitted_eta=self.gate.admitted_eta)
        await self.grant(self.admission.stepped(msg.version, msg.metrics, self.reporter.staleness_change))

    async def _on_weights_loaded(self, ident: bytes, msg: m.WeightsLoaded) -> None:
        if msg.error is not None:  # it keeps the weights it had: sent the newest again, or given up on
            error = msg.error[:1000]
            logger.warning("inference server %d could not load weights v%d: %s", msg.index, msg.version, error)
            self.reporter.fault("weight_load_failed", server=msg.index, version=msg.version, error=error)
            await self._apply(self.weights.load_failed(msg.index, msg.version, error))
            return
        await self._apply(self.weights.loaded(msg.index, msg.version))
        await self.advance()

    async def _on_eval_done(self, ident: bytes, msg: m.EvalDone) -> None:
        logger.info("%s", self.reporter.eval_done(msg.version, msg.to_payload(), self.role_stats))
        opens, finished = self.schedule.finished(msg.version)
        if opens and not self.admission.is_open:
            await self.grant(self.admission.open())
        if finished:
            self._done.set()

    async def _on_error(self, ident: bytes, msg: m.Error) -> None:
        name, text = self.sup.process_of(*self.roster.who[ident]), str(msg.message)
        if not await self.health.on_failure(name, f"reported a fatal error: {text[:300]}"):
            self.fail(f"role reported a fatal error: {text}")

    # -- actions -------------------------------------------------------------------------------------------------
    async def grant(self, grants: list[Grant]) -> None:
        for index, n in grants:
            await self._send_to(("rollout", index), m.GateGrant(n=n))  # type: ignore[arg-type]

    async def _apply(self, actions: list[Action]) -> None:
        """The weight transport's messages for the sends, then the other actions (`Health.weight_actions`)."""
        sends = [a for a in actions if isinstance(a, Send)]  # an action list never mixes sends with the others
        await self._send_all(self.weights_link.updates(sends, self.peers.__contains__))
        await self.health.weight_actions(actions)

    async def _send_all(self, messages: list[tuple[Key, str, dict]]) -> None:
        """Send what the weight transport asks for, typed (a bad message of its own raises here)."""
        for key, msg_type, payload in messages:
            await self._send_to(key, m.parse(msg_type, payload))

    async def advance(self) -> None:
        """A newer version is live on every server in the ack set: the gate moves on; evaluate if due."""
        step = self.weights.advance()
        if step is None:
            return
        # tell the learner which weight files no inference server will read again (it deletes those)
        await self._send_to(("learner", 0), m.PruneWeights(below=self.weights.lowest_needed()))
        due = self.schedule.live(*step, self.gate.version)
        # the gate moves on (not for a resumed run's checkpoint weights); reopens after a learner's rollback
        await self.grant(self.admission.went_live(step[1]))
        await self._evaluate(due)

    async def tell_rollouts(self, msg: m.ControlMessage, index: Optional[int] = None) -> None:
        """Send `msg` to every rollout worker (or only to `index`)."""
        for r in self.sup.rollouts() if index is None else [index]:
            await self._send_to(("rollout", r), msg)

    async def _maybe_start(self) -> None:
        """All roles registered: evaluate version 0, or (resumed) load the checkpoint's weights first (then evaluate)."""
        if len(self.peers) < self.sup.expected or not self.schedule.awaiting_start():
            return
        if not self.start_version:
            logger.info("all roles registered after %.1fs; evaluating version 0", self.reporter.elapsed())
            await self._evaluate(self.schedule.request(0))
        elif self.start_version not in self.weights.published:
            logger.info("all roles registered; resuming at version %d", self.start_version)
            path = self.weights_link.resume_path(self.start_version)  # the checkpoint's, published by the learner
            await self._apply(self.weights.publish(self.start_version, path))

    async def _evaluate(self, versions: list[int]) -> None:
        """Rollout worker 0 evaluates (unless it is being restarted: it gets the pending ones when it registers)."""
        for v in versions:
            await self._send_to(("rollout", 0), m.Eval(version=v, max_prompts=self.eval_max_prompts))
