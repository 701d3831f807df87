"""The controller: starts every role as a process, owns the policy version and the staleness gate, watches health.

It is a thin I/O shell over pure state machines: `Admission` (the staleness gate and its waiting rollout workers),
`WeightSync` (which server has which policy version), `Supervisor` (heartbeats, deadlines, restart policy) and
`Reporter` (metric records, accounting). Control traffic is request/response over one ROUTER socket (the roles
hold DEALERs); each message is parsed into its typed form (`arl.transport.messages`) and handled by the entry of
a dispatch table. Commands to a role are sent to its ROUTER identity, so they are never lost to a PUB/SUB slow
joiner.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import json
import logging
import os
import sys
import time
from typing import Any, Awaitable, Callable, Optional

from arl.transport import messages as m
from arl.controller.admission import Admission, Grant
from arl.controller.reporting import JsonlSink, MetricsSink, ProgressWatch, Reporter, stall_report
from arl.transport.security import advertised_address
from arl.controller.supervision import RoleLauncher, Supervisor
from arl.controller.weight_sync import Action, GiveUp, Rejoin, Send, WeightSync
from arl.learner.checkpoint import CHECKPOINT_SUBDIR, latest_checkpoint
from arl.report.page import ReportBuilder
from arl.report.traces import TraceWriter
from arl.rollout.staleness import StalenessGate, parse_group_id
from arl.transport.sockets import Router, bind_random
from arl.utils.net import free_port
from arl.utils.proc import tail

logger = logging.getLogger("arl.controller")

Key = tuple[str, int]  # (role, index)


class RunFailed(RuntimeError):
    pass


class Controller:
    def __init__(
        self,
        *,
        run_dir: str,
        supervisor: Supervisor,
        launcher: RoleLauncher,
        batch_size: int,
        max_head_offpolicyness: int,
        max_concurrent_rollouts: int,
        total_train_steps: int,
        eval_every: int,
        eval_max_prompts: int,
        progress: bool = True,
        resume: Optional[dict] = None,
        learner_ranks: int = 1,
        secret: Optional[bytes] = None,
        bind_host: str = "127.0.0.1",
        max_bytes: Optional[int] = None,
        stack_dump_wait: float = 2.0,
        sinks: Optional[list[MetricsSink]] = None,
        max_no_progress_s: float = 0.0,
        max_consecutive_drops: int = 0,
        weights_transport: str = "disk",
        weights_backend: str = "gloo",
    ) -> None:
        """`supervisor` holds the run's shape (servers, rollout workers) and its restart and timeout policy.
        `weights_transport` 'broadcast': weights go from the learner to each inference server over a group of
        their own (`arl.weights.channel`), formed when both registered, a new one per incarnation of a server."""
        self.run_dir = run_dir
        self.sup = supervisor
        self.total_steps = total_train_steps
        self.eval_every, self.eval_max_prompts = eval_every, eval_max_prompts
        self.learner_ranks = max(1, int(learner_ranks))  # > 1: the learner role runs under torchrun
        gate = StalenessGate(batch_size=batch_size, max_head_offpolicyness=max_head_offpolicyness,
                             max_concurrent=max_concurrent_rollouts, max_groups=total_train_steps * batch_size)
        # Resuming from a learner checkpoint (its arl_state.json): the gate starts at that version with the
        # consumed groups accepted; each rollout worker's prompt stream seeks to its recorded position.
        self.resume = dict(resume or {})
        self.start_version = int(self.resume.get("version", 0))
        if self.start_version:
            gate.version = self.start_version
            gate.accepted = int(self.resume.get("groups_consumed", self.start_version * batch_size))
        self._prompt_positions = {int(k): int(v) for k, v in dict(self.resume.get("data_position", {})).items()}
        self.admission = Admission(gate)
        self.weights = WeightSync(supervisor.num_inference)
        self.launcher = launcher
        self.reporter = Reporter([JsonlSink(os.path.join(run_dir, "metrics.jsonl")), *(sinks or [])],
                                 total_steps=total_train_steps, progress=progress,
                                 traces=TraceWriter(os.path.join(run_dir, "traces.jsonl")),
                                 page=ReportBuilder(run_dir))
        # no silent spinning: drops by reason on the console, a warning when no step happens, a stop when no
        # group gets through (see ProgressWatch); warnings come at a fifth of the stop budget, at most a minute
        warn = min(60.0, max_no_progress_s / 5) if max_no_progress_s else 60.0
        self.progress_watch = ProgressWatch(max_no_progress_s=max_no_progress_s,
                                            max_consecutive_drops=max_consecutive_drops, warn_after_s=warn)
        self._last_drops_shown = -1e9
        self._last_messages: dict[str, dict[str, float]] = {}  # process -> message type -> when last heard
        if weights_transport not in ("disk", "broadcast"):
            raise ValueError(f"weights_transport must be disk or broadcast, got {weights_transport!r}")
        self.broadcast = weights_transport == "broadcast"
        self._weights_backend = weights_backend
        self._weights_store: Optional[tuple[str, int]] = None  # the learner's sender (broadcast)
        self._group_numbers = itertools.count(1)  # names a fresh weight group per server incarnation (broadcast)
        self._group_nonce = os.urandom(16)
        self._secret, self._bind_host, self._max_bytes = secret, bind_host, max_bytes
        self.stack_dump_wait = stack_dump_wait
        self.router: Optional[Router] = None
        self.address = ""
        self.peers: dict[Key, bytes] = {}  # (role, index) -> router identity
        self._who: dict[bytes, Key] = {}  # router identity of a registered role -> (role, index)
        self.addresses: dict[str, Any] = {"inference": [None] * supervisor.num_inference, "learner": None}
        self.role_stats: dict[Key, dict] = {}
        self._lookups: list[bytes] = []
        self._names: list[str] = []  # the processes spawn_roles started
        self._done = asyncio.Event()
        self._failure: Optional[str] = None
        self.control_errors: dict[str, int] = {}
        self._last_ctl_warn = -1e9
        self._handlers: dict[str, Callable[[bytes, Any], Awaitable[None]]] = {
            "register": self._on_register, "lookup": self._on_lookup, "heartbeat": self._on_heartbeat,
            "gate_acquire": self._on_gate_acquire, "group_done": self._on_group_done,
            "groups_dropped": self._on_groups_dropped, "group_received": self._on_group_received,
            "weights_published": self._on_published,
            "weights_loaded": self._on_loaded, "eval_done": self._on_eval_done, "error": self._on_error,
        }

    # -- views for the launcher, scripts and tests --------------------------------------------------------------
    @property
    def gate(self) -> StalenessGate:
        return self.admission.gate

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def bind(self) -> str:
        kw = {"max_bytes": self._max_bytes} if self._max_bytes else {}
        self.router = Router(secret=self._secret, **kw)
        self.address = advertised_address(bind_random(self.router, self._bind_host))
        self._write_addresses()
        return self.address

    def _write_addresses(self) -> None:
        """run_dir/addresses.json: where every role listens (for tools and the fault tests)."""
        path = os.path.join(self.run_dir, "addresses.json")
        try:
            with open(path + ".tmp", "w") as f:
                json.dump({"controller": self.address, **self.addresses}, f)
            os.replace(path + ".tmp", path)
        except OSError as e:
            logger.warning("could not write %s: %s", path, e)

    def spawn_roles(self, python: str = sys.executable) -> None:
        base = [python, "-m", "arl.launch.role", "--run-dir", self.run_dir, "--controller", self.address]
        k = self.sup.servers_per_process
        for i in range(-(-self.sup.num_inference // k)):  # process i hosts servers i*k..i*k+k-1
            self._spawn(f"inference{i}", base + ["--role", "inference", "--index", str(i)])
        learner_argv = base + ["--role", "learner", "--index", "0"]
        if self.learner_ranks > 1 and not self.launcher.runs_ranks:  # rank 0 registers and talks to us; the others follow it (arl.learner.ranks)
            learner_argv = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(self.learner_ranks),
                            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", *learner_argv[2:]]
        self._spawn("learner", learner_argv)
        for i in range(self.sup.num_rollout):
            self._spawn(f"rollout{i}", base + ["--role", "rollout", "--index", str(i)])

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.launcher.spawn(name, argv, os.path.join(self.run_dir, "logs", f"{name}.log"))
        self._names.append(name)

    async def run(self) -> dict:
        """Run until the learner finished `total_train_steps` and the final evaluation is in."""
        tasks = [asyncio.create_task(self._serve()), asyncio.create_task(self._watch())]
        try:
            await self._done.wait()
            await self._await_learner_accounting(3.5 if self._failure is None else 2.0)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.reporter.write({"type": "summary", **self.accounting()})
            self.reporter.final_report()
        if self._failure:
            raise RunFailed(self._failure)
        return self.summary()

    async def shutdown(self, grace: float = 5.0) -> None:
        """Ask every role to exit, then make sure it did."""
        self.launcher.expect_exit()
        if self.router is not None:
            for ident in list(self.peers.values()):
                with contextlib.suppress(Exception):
                    await self._send(ident, m.Shutdown(reason="run finished"))
        if not await asyncio.to_thread(self.launcher.wait_all, grace):
            await asyncio.to_thread(self.launcher.terminate_all, 3.0)
        if self.router is not None:
            self.router.close()
        self.reporter.close()

    def fail(self, message: str) -> None:
        if self._failure is None:
            self._failure = message
        self._done.set()

    # -- watching ----------------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        while await self._check():
            await asyncio.sleep(0.2)

    async def _check(self) -> bool:
        """One round of health checks; False once the run failed."""
        for name, code in self.launcher.dead():
            if not await self._on_failure(name, f"exited with code {code}"):
                log = self.launcher.log_path(name)
                self.fail(f"role {name} exited with code {code}{self._resume_hint(name)}; last lines of {log}:\n"
                          f"{tail(log, 25)}")
                return False
        now = time.monotonic()
        late = self.sup.late(now)
        for name in [n for n in late if self.sup.servers_of(n)]:  # the run goes on without it
            late.remove(name)
            self._give_up_inference(name, f"did not register within {self.sup.startup_timeout}s of its restart")
        if late:
            self.fail(f"restarted roles did not register within {self.sup.startup_timeout}s: {late}")
            return False
        if self.sup.startup_overdue(now):
            missing = [n for n in self._names if not any(self.sup.process_of(*k) == n for k in self.peers)]
            self.fail(f"roles did not register within {self.sup.startup_timeout}s: {missing}")
            return False
        if not self._watch_progress(now):
            return False
        for key, seen in self.sup.silent(time.monotonic()):
            if self.sup.last_seen.get(key) != seen:
                continue  # handled (or heard from again) while an earlier one was investigated
            # name it with what it was waiting on and dump its stacks before it is restarted or the run stops
            why = await self._investigate_silence(key, time.monotonic() - seen)
            if not await self._on_failure(self.sup.process_of(*key), why):
                self.fail(why)
                return False
        return True

    def _watch_progress(self, now: float) -> bool:
        """Drops by reason on the console; a warning when no learner step happened for a while; False (the run
        failed, with the reason) when no group gets through. Evaluations and the time before admission opens do
        not count as no progress."""
        watch = self.progress_watch
        watch.hold(not self.admission.is_open or bool(self.reporter.pending_evals()), now)
        if watch.drops and now - self._last_drops_shown >= 1.0:
            self._last_drops_shown = now
            self.reporter.show_drops(watch.drops)
        verdict = watch.check(now)
        if verdict is None:
            return True
        self.reporter.show_drops(watch.drops)
        kind, text = verdict
        if kind == "warn":
            if not self.reporter.say(f"warning: {text}"):  # no progress bar to print above: the log (stderr)
                logger.warning("%s", text)
            self.reporter.event("no_progress_warning", text=text, drops=dict(watch.drops))
            return True
        if kind == "stall":  # nothing finished at all: say what each role is doing
            text += "\n" + self._stall_report(now)
        self.reporter.event("no_progress", reason=text, drops=dict(watch.drops))
        self.fail(f"the run is making no progress: {text}")
        return False

    def _stall_report(self, now: float) -> str:
        processes: dict[str, list[Key]] = {}
        for key in ([("rollout", i) for i in range(self.sup.num_rollout)] + [("learner", 0)]
                    + [("inference", i) for i in range(self.sup.num_inference)]):
            processes.setdefault(self.sup.process_of(*key), []).append(key)
        return stall_report(now, gate=self.gate, waiting=self.admission.waiting(), in_flight=dict(self.admission.held),
                            processes=processes, role_stats=self.role_stats, last_messages=self._last_messages)

    async def _investigate_silence(self, key: Key, silent_s: float) -> str:
        """Log which role went silent and what it was last waiting on, and have it dump its Python stacks into its
        log; returns the reason to fail or restart with."""
        role, index = key
        name = self.sup.process_of(role, index)
        waiting = str(self.role_stats.get(key, {}).get("waiting_on") or "unknown (it never said)")
        why = (f"role {role}{index} sent no heartbeat for {silent_s:.0f}s "
               f"(timeout {self.sup.heartbeat_timeouts[role]:g}s); it was last waiting on: {waiting}")
        logger.error("%s", why)
        state, dump = "?", ""
        if self.launcher.alive(name):
            state, dump = await asyncio.to_thread(self.launcher.stack_dump, name, self.stack_dump_wait)
            log = self.launcher.log_path(name)
            if dump:
                logger.error("Python stacks of %s (process state %s), from %s:\n%s", name, state, log, dump[-8000:])
                why += f"; its stacks are dumped in {log}"
            else:
                logger.error("%s (process state %s) wrote no stack dump within %gs", name, state,
                             self.stack_dump_wait)
        self.reporter.fault("heartbeat_timeout", role=f"{role}{index}", process=name, silent_s=silent_s,
                            waiting_on=waiting, process_state=state, stacks_dumped=bool(dump))
        return why

    def _resume_hint(self, name: str) -> str:
        """A lost learner ends the run (its optimizer state is in no other process): say where it can resume."""
        if name != "learner":
            return ""
        ckpt = latest_checkpoint(os.path.join(self.run_dir, CHECKPOINT_SUBDIR))
        if ckpt is None:
            return " (no checkpoint written yet: learner.checkpoint_every)"
        parent, run = os.path.split(os.path.abspath(self.run_dir))
        return (f" (newest checkpoint {ckpt}: run again with recover=auto run_dir={parent} run_name={run} to resume "
                f"from it)")

    async def _on_failure(self, name: str, reason: str) -> bool:
        """Process `name` died, went silent or reported a fatal error: restart it or go on without it, as the
        supervisor decides; False: the failure is fatal (the caller stops the run)."""
        registered = any(self.sup.process_of(*k) == name for k in self.peers)
        d = self.sup.decide(name, registered=registered, lost=self.weights.lost, rejoining=self.weights.rejoining,
                            spawned=self.launcher.has(name))
        if d.action == "fatal":
            if d.note:
                logger.error("%s failed (%s); %s", name, reason, d.note)
            return False
        log = tail(self.launcher.log_path(name), 10)
        if d.action == "restart_rollout":
            # its in-flight groups are counted as lost and their budget returned; the new process continues the
            # prompt stream from the position the old one's heartbeats reported (_on_heartbeat), gets its evaluations
            index = self.sup.rollout_index(name)
            key = ("rollout", index)
            for n_traj in self.admission.orphans(index):  # pushed, received by the learner, never reported done
                self.reporter.group_done(True, "accepted", n_traj, None, None)
            lost, grants = self.admission.worker_lost(index)
            self.reporter.groups_lost(lost)
            self._who.pop(self.peers.pop(key, b""), None)
            self.sup.forget(key)
            self.reporter.keep_env_counts(self.role_stats.pop(key, {}))
            n = self.sup.restarting(name, time.monotonic())
            logger.warning("%s %s; restarted it (restart %d of at most %d); %d in-flight groups lost, their budget "
                           "returned; last lines of its log:\n%s", name, reason, n, self.sup.max_restarts, lost, log)
            await self._grant(grants)
            await self._respawn(name, "rollout_restart", n, reason=reason[:300], lost_groups=lost)
            return True
        # an inference process: out of the routing and the weight acks (killed if it still runs)
        servers = list(d.servers)
        self.launcher.kill(name)
        self.weights.lose(servers)
        for s in servers:
            self.sup.forget(("inference", s))
            self.role_stats.pop(("inference", s), None)
        remaining = sorted(set(range(self.sup.num_inference)) - self.weights.lost)
        logger.warning("inference process %s %s; dropping servers %s, the run goes on with %s; last lines of its "
                       "log:\n%s", name, reason, servers, remaining, log)
        self.reporter.event("worker_lost", role="inference", process=name, servers=servers, reason=reason,
                            remaining=remaining)
        await self._tell_rollouts(m.WorkerLost(role="inference", indices=servers))
        if d.restart:  # its servers rejoin once registered and caught up with the newest version
            n = self.sup.restarting(name, time.monotonic())
            self.weights.restarted(servers)
            logger.warning("restarted inference process %s (restart %d of at most %d); servers %s rejoin once they "
                           "loaded the newest weights", name, n, self.sup.max_inference_restarts, servers)
            await self._respawn(name, "inference_restart", n, servers=servers)
        # a version only the lost server had not acked is live now (last: the run may end with its evaluation)
        await self._advance()
        return True

    async def _respawn(self, name: str, kind: str, restarts: int, **fields: Any) -> None:
        """Record restart number `restarts` of `name` (booked by the caller before this waits: the state machines
        must not see a lost role half restarted), then start it again, killed first if it still runs (a hung one).
        Nothing is started if the run ends (this task is cancelled) while the old process is still dying."""
        self.reporter.fault(kind, "worker_restarted", role=name, **fields, restarts=restarts)
        self.launcher.kill(name)
        for _ in range(500):
            if not self.launcher.alive(name):
                break
            await asyncio.sleep(0.02)
        self.launcher.respawn(name)

    def _give_up_inference(self, name: str, reason: str) -> None:
        """A restarted inference process that did not come back: kill it and leave its servers lost."""
        self.sup.gave_up(name)
        self.weights.lose(self.sup.servers_of(name))  # they stay lost, no longer rejoining
        self.launcher.kill(name)
        logger.error("restarted inference process %s %s; the run goes on without it", name, reason)
        self.reporter.event("fault", kind="inference_restart_failed", role=name, reason=reason)

    # -- message handling --------------------------------------------------------------------------------------
    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            ident, msg_type, payload = await self.router.recv()
            try:
                await self._dispatch(ident, msg_type, payload)
            except Exception as e:  # noqa: BLE001 - a bad control message must not kill the controller
                self._control_error("bad_payload", f"error handling {msg_type}: {type(e).__name__}: {e}",
                                    exc_info=not self.control_errors.get("bad_payload"))

    async def _dispatch(self, ident: bytes, msg_type: str, payload: Any) -> None:
        """Only registered roles may talk to the controller, except to `register`/`lookup`; a registration must
        name a role and index this run has. Everything else is dropped and counted, never acted on."""
        if msg_type not in ("register", "lookup") and ident not in self._who:
            what = f"dropped {msg_type} from an unregistered peer {ident[:16]!r}"
            if msg_type == "error" and isinstance(payload, dict):  # e.g. a role that failed before registering
                what += f": {str(payload.get('message'))[:500]}"  # (its exit itself is handled by _watch)
            self._control_error("unknown_peer", what)  # rate-limited: a flood must not flood the log
            return
        handler = self._handlers.get(msg_type)
        if handler is None:
            logger.warning("controller: unexpected message type %s", msg_type)
            return
        try:
            msg = m.parse(msg_type, payload)
        except ValueError as e:
            self._control_error("bad_register" if msg_type == "register" else "bad_payload", f"refused {msg_type}: {e}")
            return
        await handler(ident, msg)
        key = self._who.get(ident)
        if key is not None:  # for the stall report: when each process last sent each kind of message
            self._last_messages.setdefault(self.sup.process_of(*key), {})[msg_type] = time.monotonic()

    def _control_error(self, kind: str, text: str, exc_info: bool = False) -> None:
        """Count a refused control message; log at most one per second (a flood must not flood the log)."""
        self.control_errors[kind] = self.control_errors.get(kind, 0) + 1
        now = time.monotonic()
        if exc_info or now - self._last_ctl_warn >= 1.0:
            self._last_ctl_warn = now
            logger.warning("controller: %s (refused so far: %s)", text, self.control_errors, exc_info=exc_info)

    async def _send(self, ident: bytes, msg: m.ControlMessage) -> None:
        assert self.router is not None
        await self.router.send(ident, msg.TYPE, msg.to_payload())

    async def _send_to(self, key: Key, msg: m.ControlMessage) -> None:
        """Send to role `key` if it is registered (else it is being restarted, or gone)."""
        ident = self.peers.get(key)
        if ident is not None:
            await self._send(ident, msg)

    async def _on_register(self, ident: bytes, msg: m.Register) -> None:
        limit = {"inference": self.sup.num_inference, "learner": 1, "rollout": self.sup.num_rollout}[msg.role]
        if not 0 <= msg.index < limit or (msg.role == "inference" and msg.address is None):
            self._control_error("bad_register", f"refused a registration as {msg.role}/{msg.index}")
            return
        key = (msg.role, msg.index)
        old = self.peers.get(key)
        if old is not None and old != ident and key in self.sup.last_seen:
            # a role's identity is bound at registration: only a new incarnation (the old one died or was
            # dropped, so it is no longer heard) may register under its key, never a second peer beside it
            self._control_error("register_taken", f"refused a registration as {msg.role}{msg.index} from peer "
                                                  f"{ident[:16]!r}: that role is registered and alive")
            return
        self._who.pop(self.peers.get(key, b""), None)  # a new incarnation: the old one's identity is no longer heard
        self.peers[key] = ident
        self._who[ident] = key
        restarted = self.sup.registered(key, time.monotonic(), len(self.peers))
        if msg.role == "inference":
            self.addresses["inference"][msg.index] = msg.address
        elif msg.role == "learner":
            self.addresses["learner"] = msg.address
            if self.broadcast and msg.weights_store:
                host, _, port = msg.weights_store.rpartition(":")
                self._weights_store = (host, int(port))
        logger.info("registered %s%d (pid %s)", msg.role, msg.index, msg.pid)
        placed = self.launcher.where(self.sup.process_of(*key))  # {} where there is nothing to say (one host)
        if placed:
            self.reporter.event("role_placed", role=f"{msg.role}{msg.index}", process=self.sup.process_of(*key),
                                **placed)
        self._write_addresses()
        position = self._prompt_positions.get(msg.index) if msg.role == "rollout" else None
        await self._send(ident, m.Ack(ok=True, prompt_position=position))
        # broadcast: a weight group for each inference server once it and the learner registered (a server's is
        # formed before it is sent anything to load)
        if self.broadcast and msg.role != "rollout":
            for server in range(self.sup.num_inference) if msg.role == "learner" else [msg.index]:
                await self._form_weight_group(server)
        if msg.role == "inference":
            await self._apply(self.weights.registered(msg.index))  # a restarted server catches up, then rejoins
        await self._answer_lookups()
        await self._maybe_start()
        if restarted and key == ("rollout", 0):  # evaluations it was running died with it: ask again
            for v in self.reporter.pending_evals():
                await self._send(ident, m.Eval(version=v, max_prompts=self.eval_max_prompts))

    async def _on_lookup(self, ident: bytes, msg: m.Lookup) -> None:
        self._lookups.append(ident)
        await self._answer_lookups()

    async def _on_heartbeat(self, ident: bytes, msg: m.Heartbeat) -> None:
        key = (msg.role, msg.index)
        self.sup.heard(key, time.monotonic())
        self.role_stats[key] = msg.stats
        pos = msg.stats.get("prompt_position") if msg.role == "rollout" else None
        if isinstance(pos, int):  # a restarted rollout worker continues its prompt stream from here
            self._prompt_positions[msg.index] = max(self._prompt_positions.get(msg.index, 0), pos)

    def _rollout_index(self, ident: bytes, what: str) -> Optional[int]:
        role, index = self._who[ident]
        if role != "rollout":
            self._control_error(f"unexpected_{what}", f"dropped a {what} from {role}{index}")
            return None
        return index

    async def _on_gate_acquire(self, ident: bytes, msg: m.GateAcquire) -> None:
        index = self._rollout_index(ident, "gate_acquire")
        if index is not None:
            await self._grant(self.admission.acquire(index, msg.want, msg.incarnation))

    async def _on_group_done(self, ident: bytes, msg: m.GroupDone) -> None:
        index = self._rollout_index(ident, "group_done")
        if index is None:
            return
        try:
            grants = self.admission.group_done(index, msg.accepted, msg.group_id)
        except ValueError:
            self._control_error("unexpected_group_done", "dropped a group_done for no running group")
            return
        self.reporter.group_done(msg.accepted, msg.reason, msg.n_traj, msg.traj_stats, msg.n_traj_raw, msg.traces)
        if msg.accepted:
            self.progress_watch.accepted(time.monotonic())
        else:
            self.progress_watch.dropped(str(msg.reason), time.monotonic(), error=msg.error)
        await self._grant(grants)

    async def _on_groups_dropped(self, ident: bytes, msg: m.GroupsDropped) -> None:
        if not self._from_learner(ident, "groups_dropped"):
            return
        n = msg.n
        for gid in msg.group_ids or []:  # settled first: a drop must not overtake its group's acceptance
            if not self._settle(gid, 0):
                n -= 1  # no group of this run: there is no budget to give back
        if n <= 0:
            return
        self.reporter.group_reasons["dropped_" + msg.reason] += n
        self.progress_watch.dropped("learner_" + msg.reason, time.monotonic(), n, streak=False)
        await self._grant(self.admission.groups_dropped(n))

    async def _on_group_received(self, ident: bytes, msg: m.GroupReceived) -> None:
        if self._from_learner(ident, "group_received"):
            self._settle(msg.group_id, msg.n_traj)

    def _from_learner(self, ident: bytes, what: str) -> bool:
        if self._who[ident][0] != "learner":
            self._control_error(f"unexpected_{what}", f"dropped a {what} from {self._who[ident]}")
            return False
        return True

    def _settle(self, group_id: str, n_traj: int) -> bool:
        """The learner has group `group_id`: it is accepted whatever its rollout worker does next (see
        `Admission.received`); False if no rollout worker of this run holds or held it."""
        who = parse_group_id(group_id)
        outcome = "unknown" if who is None else self.admission.received(who[0], who[1], group_id, n_traj)
        if outcome == "unknown":
            self._control_error("unknown_group", f"the learner reports group {group_id[:60]!r}, which no rollout "
                                                 "worker holds")
            return False
        if outcome == "reclaimed":  # its worker died after pushing it: counted lost, now accepted
            self.reporter.groups_lost(-1)
            self.reporter.group_done(True, "accepted", n_traj, None, None)
            self.progress_watch.accepted(time.monotonic())
        return True

    async def _on_published(self, ident: bytes, msg: m.WeightsPublished) -> None:
        self.progress_watch.stepped(time.monotonic())
        await self._apply(self.weights.publish(msg.version, msg.path))
        self.reporter.train(msg.version, msg.metrics, self.role_stats)

    async def _on_loaded(self, ident: bytes, msg: m.WeightsLoaded) -> None:
        if msg.error is not None:  # it keeps the weights it had: sent the newest again, or given up on
            error = msg.error[:1000]
            logger.warning("inference server %d could not load weights v%d: %s", msg.index, msg.version, error)
            self.reporter.fault("weight_load_failed", server=msg.index, version=msg.version, error=error)
            await self._apply(self.weights.load_failed(msg.index, msg.version, error))
            return
        await self._apply(self.weights.loaded(msg.index, msg.version))
        await self._advance()

    async def _on_eval_done(self, ident: bytes, msg: m.EvalDone) -> None:
        logger.info("%s", self.reporter.eval_done(msg.version, msg.to_payload(), self.role_stats))
        if msg.version == self.start_version and not self.admission.is_open:
            await self._grant(self.admission.open())
        if msg.version >= self.total_steps and not self.reporter.pending_evals():
            self._done.set()

    async def _on_error(self, ident: bytes, msg: m.Error) -> None:
        text = str(msg.message)
        if not await self._on_failure(self.sup.process_of(*self._who[ident]), f"reported a fatal error: {text[:300]}"):
            self.fail(f"role reported a fatal error: {text}")

    # -- actions -------------------------------------------------------------------------------------------------
    async def _grant(self, grants: list[Grant]) -> None:
        for index, n in grants:
            await self._send_to(("rollout", index), m.GateGrant(n=n))  # type: ignore[arg-type]

    async def _apply(self, actions: list[Action]) -> None:
        sends: dict[int, list[int]] = {}  # broadcast: version -> servers the learner sends it to
        for a in actions:
            if isinstance(a, Send):
                if self.broadcast and ("inference", a.server) in self.peers:
                    sends.setdefault(a.version, []).append(a.server)
                await self._send_to(("inference", a.server), m.UpdateWeights(version=a.version, path=a.path))
            elif isinstance(a, Rejoin):
                await self._rejoin(a)
            elif isinstance(a, GiveUp):  # handled as the failure of its process: restarted, dropped or fatal
                why = f"could not load weights v{a.version} ({a.attempts} tries in a row): {a.error}"
                if not await self._on_failure(self.sup.process_of("inference", a.server), why):
                    self.fail(f"inference server {a.server} {why}")
        for version, servers in sends.items():
            await self._send_to(("learner", 0), m.SendWeights(version=version, servers=servers))

    async def _form_weight_group(self, server: int) -> None:
        """Broadcast: a new weight group between the learner and inference server `server` (its new incarnation),
        once both registered; the learner closes the server's previous group."""
        if self._weights_store is None or ("inference", server) not in self.peers:
            return
        # unguessable (the store has no access control): a tag derived from the run's secret and a nonce of this
        # controller, so a peer that reaches the store cannot name a group it was not told (docs/reliability.md)
        base = f"arl-weights-s{server}-{next(self._group_numbers)}"
        tag = hmac.new(self._secret or self._group_nonce, self._group_nonce + base.encode(), hashlib.sha256)
        name = f"{base}-{tag.hexdigest()[:32]}"
        host, port = self._weights_store
        spec = {"master_address": host, "master_port": port, "group_name": name, "world_size": 2, "rank": 1,
                "backend": self._weights_backend}  # arl.weights.broadcast.GroupSpec (no torch import here)
        await self._send_to(("learner", 0), m.OpenWeightGroup(name=name, server=server))
        await self._send_to(("inference", server), m.JoinWeightGroup(index=server, spec=spec))

    async def _rejoin(self, a: Rejoin) -> None:
        """Route to restarted server `a.server` again: the rollout workers connect to its new address."""
        self.sup.heard(("inference", a.server), time.monotonic())
        address = self.addresses["inference"][a.server]
        logger.warning("inference server %d is back (at %s) with version %s", a.server, address, a.version)
        self.reporter.event("worker_back", role="inference", server=a.server, address=address)
        await self._tell_rollouts(m.WorkerBack(role="inference", index=a.server, address=address))

    async def _advance(self) -> None:
        """A newer version is live on every server in the ack set: the gate moves on; evaluate if due."""
        step = self.weights.advance()
        if step is None:
            return
        prev, v = step
        # tell the learner which weight files no inference server will read again (it deletes those)
        await self._send_to(("learner", 0), m.PruneWeights(below=self.weights.lowest_needed()))
        if v <= self.gate.version:  # resumed run: the checkpoint's weights are live everywhere
            if v == self.start_version and v not in self.reporter.evals:
                await self._request_eval(v)
            return
        await self._grant(self.admission.set_version(v))
        # versions skipped by coalesced updates still count: an evaluation due at one of them runs at `v`
        if v >= self.total_steps or (self.eval_every and any(u % self.eval_every == 0 for u in range(prev + 1, v + 1))):
            await self._request_eval(v)

    async def _tell_rollouts(self, msg: m.ControlMessage) -> None:
        for r in range(self.sup.num_rollout):
            await self._send_to(("rollout", r), msg)

    async def _answer_lookups(self) -> None:
        if None in self.addresses["inference"] or self.addresses["learner"] is None:
            return
        while self._lookups:
            await self._send(self._lookups.pop(), m.Addresses(**self.addresses))

    async def _maybe_start(self) -> None:
        """All roles registered: evaluate version 0, or (resumed) load the checkpoint's weights first; the
        evaluation follows in _advance."""
        if len(self.peers) < self.sup.expected or self.start_version in self.reporter.evals:
            return
        if not self.start_version:
            logger.info("all roles registered after %.1fs; evaluating version 0", self.reporter.elapsed())
            await self._request_eval(0)
        elif self.start_version not in self.weights.published:
            logger.info("all roles registered; resuming at version %d", self.start_version)
            path = "" if self.broadcast else os.path.join(self.run_dir, "weights", f"v{self.start_version}.safetensors")
            await self._apply(self.weights.publish(self.start_version, path))

    async def _request_eval(self, version: int) -> None:
        self.reporter.eval_requested(version)
        # unless rollout0 is being restarted: it gets the pending evaluations when it registers
        await self._send_to(("rollout", 0), m.Eval(version=version, max_prompts=self.eval_max_prompts))

    # -- the end -------------------------------------------------------------------------------------------------
    async def _await_learner_accounting(self, timeout: float) -> None:
        """Give the learner's heartbeat (1 s) a moment to catch up with the groups accepted so far, so the final
        accounting compares counts taken at (nearly) the same time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.role_stats.get(("learner", 0), {})
            caught_up = (int(st.get("groups_received", -1)) >= self.reporter.accepted_groups
                         and int(st.get("version", -1)) >= self.gate.version and not st.get("in_step_groups"))
            if caught_up and (self._failure is not None or not self.gate.running):
                return
            await asyncio.sleep(0.2)

    def accounting(self) -> dict:
        transport = {"controller": dict(self.router.stats) if self.router is not None else {},
                     "controller_refused": dict(self.control_errors)}
        return self.reporter.accounting(role_stats=self.role_stats, steps=self.gate.version,
                                        running_groups=self.gate.running, failure=self._failure,
                                        rollout_restarts=self.sup.restarts,
                                        inference_restarts=self.sup.inference_restarts, transport=transport)

    def summary(self) -> dict:
        return {
            "run_dir": self.run_dir,
            "steps": self.gate.version,
            "evals": {v: (e["first_acc"], e["solved_acc"]) for v, e in sorted(self.reporter.evals.items()) if e},
            "groups": dict(self.reporter.group_reasons),
            "lost_inference": sorted(self.weights.lost),
            "seconds": self.reporter.elapsed(),
        }
