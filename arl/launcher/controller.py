"""The controller: starts every role as a process, owns the policy version and the staleness gate, watches health.

Control traffic is request/response over one ROUTER socket (the roles hold DEALERs). Commands to a role are
sent to its ROUTER identity, so they are never lost to a PUB/SUB slow joiner.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Optional, Sequence

from arl.launcher.forensics import request_stack_dump
from arl.launcher.process import Child, ProcessGroup, _signal_group, tail
from arl.launcher.security import advertised_address
from arl.report.page import ReportBuilder
from arl.report.trackers import make_tracker
from arl.report.traces import TraceWriter
from arl.rollout.staleness import StalenessGate
from arl.transport.sockets import Router, bind_random

logger = logging.getLogger("arl.launcher")


class RunFailed(RuntimeError):
    pass


class MetricsWriter:
    """Appends one JSON object per line to metrics.jsonl (flushed at once, so a crash keeps the history)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._f = open(path, "a", buffering=1)

    def write(self, record: dict) -> None:
        record = {"time": time.time(), **record}
        self._f.write(json.dumps(record, default=float) + "\n")

    def close(self) -> None:
        self._f.close()


class Controller:
    def __init__(
        self,
        *,
        run_dir: str,
        num_inference: int,
        num_rollout: int,
        batch_size: int,
        max_head_offpolicyness: int,
        max_concurrent_rollouts: int,
        total_train_steps: int,
        eval_every: int,
        eval_max_prompts: int,
        startup_timeout: float,
        heartbeat_timeout: float = 120.0,
        progress: bool = True,
        servers_per_process: int = 1,
        tolerate_inference_loss: bool = False,
        resume: Optional[dict] = None,
        learner_ranks: int = 1,
        heartbeat_timeouts: Optional[dict[str, float]] = None,
        restart_rollout: bool = True,
        max_restarts: int = 3,
        restart_inference: bool = False,
        max_inference_restarts: int = 3,
        secret: Optional[bytes] = None,
        bind_host: str = "127.0.0.1",
        max_bytes: Optional[int] = None,
        stack_dump_wait: float = 2.0,
        loggers: Sequence[str] = ("jsonl",),
        tracker_config: Optional[dict] = None,
        experiment_name: str = "",
    ) -> None:
        self.run_dir = run_dir
        self.num_inference, self.num_rollout = num_inference, num_rollout
        self.servers_per_process = max(1, servers_per_process)  # inference servers hosted by one process
        # an inference process that dies (or stops heartbeating) is dropped instead of failing the run, while
        # another inference server remains: it leaves the weight-ack set and rollout workers re-send its requests
        self.tolerate_inference_loss = tolerate_inference_loss
        self.lost_inference: set[int] = set()  # server indices
        self.total_steps = total_train_steps
        self.eval_every, self.eval_max_prompts = eval_every, eval_max_prompts
        self.startup_timeout = startup_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.gate = StalenessGate(
            batch_size=batch_size,
            max_head_offpolicyness=max_head_offpolicyness,
            max_concurrent=max_concurrent_rollouts,
            max_groups=total_train_steps * batch_size,
        )
        # Resuming from a learner checkpoint (its arl_state.json): the gate starts at that version with the
        # consumed groups accepted; each rollout worker's prompt stream seeks to its recorded position.
        self.learner_ranks = max(1, int(learner_ranks))  # > 1: the learner role runs under torchrun
        self.resume = dict(resume or {})
        self.start_version = int(self.resume.get("version", 0))
        if self.start_version:
            self.gate.version = self.start_version
            self.gate.accepted = int(self.resume.get("groups_consumed", self.start_version * batch_size))
        self._prompt_positions = {int(k): int(v) for k, v in dict(self.resume.get("data_position", {})).items()}
        self.procs = ProcessGroup()
        # reporting (arl.report): metrics.jsonl + chosen trackers, traces.jsonl, report.html
        self.metrics = make_tracker(list(loggers), run_dir, dict(tracker_config or {}), experiment_name)
        self.traces = TraceWriter(os.path.join(run_dir, "traces.jsonl"))
        self.report = ReportBuilder(run_dir)
        self.router: Optional[Router] = None
        self.address = ""
        self.peers: dict[tuple[str, int], bytes] = {}  # (role, index) -> router identity
        self.addresses: dict[str, Any] = {"inference": [None] * num_inference, "learner": None}
        self.last_seen: dict[tuple[str, int], float] = {}
        self.role_stats: dict[tuple[str, int], dict] = {}
        self._lookups: list[bytes] = []
        self._wants: collections.deque[list] = collections.deque()  # [identity, remaining]
        self._loaded: dict[int, set[int]] = collections.defaultdict(set)  # version -> inference indices
        self._published: dict[int, str] = {}
        self._evals: dict[int, dict] = {}
        self._eval_pending: set[int] = set()
        self._training_open = False
        self._last_step_metrics: dict = {}
        self._done = asyncio.Event()
        self._failure: Optional[str] = None
        self._group_reasons: collections.Counter = collections.Counter()
        self._traj_sums: collections.Counter = collections.Counter()  # trajectory metadata since the last step
        self._progress = progress
        self._bar: Any = None
        self._t_start = time.monotonic()
        self._infer_busy_prev: dict[int, tuple[float, float]] = {}
        # -- reliability (issue 7): per-role heartbeat timeouts, rollout restarts, peer checks, accounting
        self.heartbeat_timeouts = {r: heartbeat_timeout for r in ("inference", "learner", "rollout")}
        self.heartbeat_timeouts.update(heartbeat_timeouts or {})
        self.restart_rollout, self.max_restarts = restart_rollout, max_restarts
        self.restarts = 0
        self.restart_inference, self.max_inference_restarts = restart_inference, max_inference_restarts
        self.inference_restarts = 0
        self._rejoining: set[int] = set()  # restarted inference servers not yet routed to again
        self._restarted_at: dict[str, float] = {}  # process name -> when it was restarted (until it registers)
        self._secret, self._bind_host, self._max_bytes = secret, bind_host, max_bytes
        self.stack_dump_wait = stack_dump_wait
        self._known_idents: set[bytes] = set()  # router identities of registered roles
        self._rollout_of: dict[bytes, int] = {}  # rollout identity -> index
        self._held: collections.Counter = collections.Counter()  # rollout index -> granted groups not yet done
        self.accepted_groups = self.accepted_trajectories = self.lost_groups = 0
        self.control_errors: collections.Counter = collections.Counter()
        self._last_ctl_warn = -1e9
        self.faults: list[dict] = []
        self._env_of_restarted: collections.Counter = collections.Counter()

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
        base = [python, "-m", "arl.launcher.worker", "--run-dir", self.run_dir, "--controller", self.address]
        logs = os.path.join(self.run_dir, "logs")
        for i in range(-(-self.num_inference // self.servers_per_process)):  # process i hosts servers i*k..i*k+k-1
            self.procs.spawn(f"inference{i}", base + ["--role", "inference", "--index", str(i)],
                             os.path.join(logs, f"inference{i}.log"))
        learner_argv = base + ["--role", "learner", "--index", "0"]
        if self.learner_ranks > 1:  # rank 0 registers and talks to us; the others follow it (arl.learner.ranks)
            import socket

            with socket.socket() as sock:  # torchrun's rendezvous port
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            learner_argv = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(self.learner_ranks),
                            "--master_addr", "127.0.0.1", "--master_port", str(port), "-m",
                            *learner_argv[2:]]
        self.procs.spawn("learner", learner_argv, os.path.join(logs, "learner.log"))
        for i in range(self.num_rollout):
            self.procs.spawn(f"rollout{i}", base + ["--role", "rollout", "--index", str(i)],
                             os.path.join(logs, f"rollout{i}.log"))

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
            self.metrics.write({"type": "summary", **self.accounting()})
            self.report.build()  # the final report, with the summary
        if self._failure:
            raise RunFailed(self._failure)
        return self.summary()

    async def shutdown(self, grace: float = 5.0) -> None:
        """Ask every role to exit, then make sure it did."""
        self.procs.expect_exit()
        if self.router is not None:
            for ident in list(self.peers.values()):
                try:
                    await self.router.send(ident, "shutdown", {"reason": "run finished"})
                except Exception:  # noqa: BLE001
                    pass
        loop = asyncio.get_running_loop()
        exited = await loop.run_in_executor(None, self.procs.wait_all, grace)
        if not exited:
            await loop.run_in_executor(None, self.procs.terminate, 3.0)
        if self.router is not None:
            self.router.close()
        if self._bar is not None:
            self._bar.close()
        self.metrics.close()
        self.traces.close()

    def fail(self, message: str) -> None:
        if self._failure is None:
            self._failure = message
        self._done.set()

    # -- watching ----------------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        started = time.monotonic()
        all_up = False  # every role registered once (later gaps are restarts, timed by _restarted_at)
        while True:
            await asyncio.sleep(0.2)
            for child in self.procs.dead():
                code = child.proc.returncode
                if await self._restart_rollout(child.name, f"exited with code {code}"):
                    continue
                if await self._lose_inference(child.name, f"exited with code {code}"):
                    continue
                self.fail(
                    f"role {child.name} exited with code {code}; last lines of {child.log_path}:\n"
                    f"{tail(child.log_path, 25)}"
                )
                return
            registered = len(self.peers)
            expected = self.num_inference + self.num_rollout + 1
            all_up = all_up or registered >= expected
            late = [n for n, t in self._restarted_at.items() if time.monotonic() - t > self.startup_timeout]
            for name in [n for n in late if self._inference_servers(n)]:  # the run goes on without it
                late.remove(name)
                self._give_up_inference(name, f"did not register within {self.startup_timeout}s of its restart")
            if late:
                self.fail(f"restarted roles did not register within {self.startup_timeout}s: {late}")
                return
            if not all_up and time.monotonic() - started > self.startup_timeout:
                missing = [c.name for c in self.procs.children.values() if not self._is_registered(c.name)]
                self.fail(f"roles did not register within {self.startup_timeout}s: {missing}")
                return
            now = time.monotonic()
            for key, seen in list(self.last_seen.items()):
                if now - seen > self.heartbeat_timeouts.get(key[0], self.heartbeat_timeout):
                    if self.last_seen.get(key) != seen:
                        continue  # handled (or heard from again) while an earlier one was investigated
                    # name it with what it was waiting on and dump its stacks before it is restarted or the run stops
                    why = await self._investigate_silence(key, now - seen)
                    if key[0] == "rollout" and await self._restart_rollout(f"rollout{key[1]}", why):
                        continue
                    if key[0] == "inference" and self._can_lose_inference(self._inference_process(key[1])):
                        name = self._inference_process(key[1])
                        child = self.procs.children.get(name)
                        if child is not None:  # hung: kill it so it cannot come back half-alive
                            child.expected_exit = True
                            _signal_group(child.proc.pid, signal.SIGKILL)
                        await self._lose_inference(name, why)
                        continue
                    self.fail(why)
                    return

    async def _investigate_silence(self, key: tuple[str, int], silent_s: float) -> str:
        """Log which role went silent and what it was last waiting on, and have it dump its Python stacks into its
        own log (faulthandler on SIGUSR1, see arl.launcher.forensics). Returns the one-line description."""
        role, index = key
        name = self._inference_process(index) if role == "inference" else ("learner" if role == "learner"
                                                                             else f"{role}{index}")
        child = self.procs.children.get(name)
        waiting = str(self.role_stats.get(key, {}).get("waiting_on") or "unknown (it never said)")
        timeout = self.heartbeat_timeouts.get(role, self.heartbeat_timeout)
        why = (f"role {role}{index} sent no heartbeat for {silent_s:.0f}s (timeout {timeout:g}s); "
               f"it was last waiting on: {waiting}")
        logger.error("%s", why)
        state, dump = "?", ""
        if child is not None and child.proc.poll() is None:
            state, dump = await asyncio.to_thread(request_stack_dump, child.proc.pid, child.log_path,
                                                  self.stack_dump_wait)
            if dump:
                logger.error("Python stacks of %s (pid %d, process state %s), from %s:\n%s", name, child.proc.pid,
                             state, child.log_path, dump[-8000:])
                why += f"; its stacks are dumped in {child.log_path}"
            else:
                logger.error("%s (pid %d, process state %s) wrote no stack dump within %gs", name, child.proc.pid,
                             state, self.stack_dump_wait)
        fault = {"kind": "heartbeat_timeout", "role": f"{role}{index}", "process": name, "silent_s": silent_s,
                 "waiting_on": waiting, "process_state": state, "stacks_dumped": bool(dump)}
        self.faults.append(fault)
        self.metrics.write({"type": "fault", "elapsed": time.monotonic() - self._t_start, **fault})
        return why

    async def _restart_rollout(self, name: str, reason: str) -> bool:
        """Restart rollout process `name` (dead, or silent: it is killed first) if configured and under the
        restart cap. Its in-flight groups are counted as lost and their staleness budget returned. False: the
        caller treats the failure as fatal."""
        if not name.startswith("rollout") or not name[len("rollout"):].isdigit() or not self.restart_rollout:
            return False
        child = self.procs.children.get(name)
        if child is None:
            return False
        if self.restarts >= self.max_restarts:
            logger.error("%s failed (%s) and the run already restarted %d rollout workers (max_restarts)", name,
                         reason, self.restarts)
            return False
        index = int(name[len("rollout"):])
        if ("rollout", index) not in self.peers:  # it failed while starting: a restart would fail the same way
            logger.error("%s failed (%s) before it registered; not restarting it", name, reason)
            return False
        await self._respawn(child)
        self.restarts += 1
        key = ("rollout", index)
        lost = self._held.pop(index, 0)
        if lost:
            self.gate.release(lost)
            self.lost_groups += lost
            self._group_reasons["lost_worker_died"] += lost
        ident = self.peers.pop(key, None)
        if ident is not None:
            self._known_idents.discard(ident)
            self._rollout_of.pop(ident, None)
            self._wants = collections.deque(w for w in self._wants if w[0] != ident)
        self.last_seen.pop(key, None)
        old_stats = self.role_stats.pop(key, {})
        old_env = dict(old_stats.get("env") or {})  # keep the dead incarnation's env counts
        if isinstance(old_stats.get("prompt_position"), int):  # the new one continues its prompt stream
            self._prompt_positions[index] = max(old_stats["prompt_position"], self._prompt_positions.get(index, 0))
        self._env_of_restarted.update({k: v for k, v in old_env.items() if k != "env_calls_in_flight"})
        logger.warning("%s %s; restarted it (restart %d of at most %d); %d in-flight groups lost, their budget "
                       "returned; last lines of its log:\n%s", name, reason, self.restarts, self.max_restarts, lost,
                       tail(child.log_path, 10))
        fault = {"kind": "rollout_restart", "role": name, "reason": reason[:300], "lost_groups": lost,
                 "restarts": self.restarts}
        self.faults.append(fault)
        self.metrics.write({"type": "worker_restarted", "elapsed": time.monotonic() - self._t_start, **fault})
        await self._grant()
        return True

    async def _respawn(self, child: Child) -> None:
        """Start `child`'s role again (killed first if it still runs: a hung one); its registration is timed from
        now (`_restarted_at`)."""
        if child.proc.poll() is None:
            child.expected_exit = True
            _signal_group(child.proc.pid, signal.SIGKILL)
            await asyncio.to_thread(child.proc.wait, 10.0)
        self.procs.respawn(child.name)
        self._restarted_at[child.name] = time.monotonic()

    async def _tell_rollouts(self, msg_type: str, payload: dict) -> None:
        """Send a control message to every registered rollout worker."""
        for r in range(self.num_rollout):
            ident = self.peers.get(("rollout", r))
            if ident is not None:
                await self.router.send(ident, msg_type, payload)

    def _inference_process(self, server: int) -> str:
        return f"inference{server // self.servers_per_process}"

    def _inference_servers(self, name: str) -> list[int]:
        """Server indices hosted by process `name` ('inference<i>'); [] for other roles."""
        if not name.startswith("inference") or not name[len("inference"):].isdigit():
            return []
        first = int(name[len("inference"):]) * self.servers_per_process
        return list(range(first, min(self.num_inference, first + self.servers_per_process)))

    def _can_lose_inference(self, name: str) -> bool:
        servers = set(self._inference_servers(name))
        all_registered = len(self.peers) >= self.num_inference + self.num_rollout + 1
        remaining = set(range(self.num_inference)) - self.lost_inference - servers
        return bool(servers) and self.tolerate_inference_loss and all_registered and bool(remaining)

    async def _lose_inference(self, name: str, reason: str) -> bool:
        """Drop inference process `name` if the run can go on without it; False: the loss is fatal."""
        if not self._can_lose_inference(name):
            return False
        # a restarted process that dies before it rejoined is lost again (and may be restarted again)
        servers = [s for s in self._inference_servers(name) if s not in self.lost_inference or s in self._rejoining]
        child = self.procs.children.get(name)
        if child is not None:
            child.expected_exit = True
        self.lost_inference.update(servers)
        for s in servers:
            self.last_seen.pop(("inference", s), None)
            self.role_stats.pop(("inference", s), None)
        remaining = sorted(set(range(self.num_inference)) - self.lost_inference)
        logger.warning("inference process %s %s; dropping servers %s, the run goes on with %s%s", name, reason,
                       servers, remaining,
                       f"; last lines of its log:\n{tail(child.log_path, 10)}" if child is not None else "")
        self.metrics.write({"type": "worker_lost", "role": "inference", "process": name, "servers": servers,
                            "reason": reason, "remaining": remaining, "elapsed": time.monotonic() - self._t_start})
        await self._tell_rollouts("worker_lost", {"role": "inference", "indices": servers})
        for v in sorted(self._published):  # a version only the lost worker had not acked is complete now
            await self._check_loaded(v)
        await self._restart_inference(name, servers)
        return True

    async def _restart_inference(self, name: str, servers: list[int]) -> None:
        """Start dropped inference process `name` again, if configured and under the cap. Its servers stay out of
        the routing and the weight acks until they registered and loaded the newest version (`_rejoin`)."""
        if not servers or not self.restart_inference or self.inference_restarts >= self.max_inference_restarts:
            return
        child = self.procs.children.get(name)
        if child is None:
            return
        await self._respawn(child)
        self.inference_restarts += 1
        self._rejoining.update(servers)
        logger.warning("restarted inference process %s (restart %d of at most %d); servers %s rejoin once they "
                       "loaded the newest weights", name, self.inference_restarts, self.max_inference_restarts,
                       servers)
        fault = {"kind": "inference_restart", "role": name, "servers": servers, "restarts": self.inference_restarts}
        self.faults.append(fault)
        self.metrics.write({"type": "worker_restarted", "elapsed": time.monotonic() - self._t_start, **fault})

    def _give_up_inference(self, name: str, reason: str) -> None:
        """A restarted inference process that did not come back: kill it and leave its servers lost."""
        self._restarted_at.pop(name, None)
        self._rejoining.difference_update(self._inference_servers(name))
        child = self.procs.children.get(name)
        if child is not None:
            child.expected_exit = True
            if child.proc.poll() is None:
                _signal_group(child.proc.pid, signal.SIGKILL)
        logger.error("restarted inference process %s %s; the run goes on without it", name, reason)
        self.metrics.write({"type": "fault", "kind": "inference_restart_failed", "role": name, "reason": reason,
                            "elapsed": time.monotonic() - self._t_start})

    async def _send_rejoin_weights(self, server: int) -> None:
        """A restarted server registered: have it load the newest published version (or rejoin at once if the
        run has published none: it started with the initial weights)."""
        if not self._published:
            await self._rejoin(server)
            return
        v = max(self._published)
        await self.router.send(self.peers[("inference", server)], "update_weights",
                               {"version": v, "path": self._published[v]})

    async def _rejoin(self, server: int) -> None:
        """Route to restarted server `server` again: back in the weight-ack set, and the rollout workers connect
        to its new address."""
        self._rejoining.discard(server)
        self.lost_inference.discard(server)
        self.last_seen[("inference", server)] = time.monotonic()
        address = self.addresses["inference"][server]
        logger.warning("inference server %d is back (at %s) with version %s", server, address,
                       max(self._published) if self._published else 0)
        self.metrics.write({"type": "worker_back", "role": "inference", "server": server, "address": address,
                            "elapsed": time.monotonic() - self._t_start})
        await self._tell_rollouts("worker_back", {"role": "inference", "index": server, "address": address})

    def _is_registered(self, name: str) -> bool:
        return any(f"{r}{i}" == name or (r == "learner" and name == "learner") for r, i in self.peers)

    # -- message handling --------------------------------------------------------------------------------------
    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            ident, msg_type, payload = await self.router.recv()
            try:
                if not self._admit(ident, msg_type, payload):
                    continue
                await self._handle(ident, msg_type, payload)
            except Exception as e:  # noqa: BLE001 - a bad control message must not kill the controller
                self._control_error("bad_payload", f"error handling {msg_type}: {type(e).__name__}: {e}",
                                    exc_info=not self.control_errors["bad_payload"])

    def _admit(self, ident: bytes, msg_type: str, p: dict) -> bool:
        """Only registered roles may talk to the controller, except to `register`/`lookup`; a registration must
        name a role and index this run has. Everything else is dropped and counted, never acted on."""
        if msg_type == "lookup":
            return True
        if msg_type == "register":
            role, index = p.get("role"), p.get("index", 0)
            limit = {"inference": self.num_inference, "learner": 1, "rollout": self.num_rollout}.get(role, 0)
            if type(index) is not int or not 0 <= index < limit or (
                    role == "inference" and not isinstance(p.get("address"), str)):
                self._control_error("bad_register", f"refused a registration as {str(role)[:20]}/{index!r:.20}")
                return False
            self._known_idents.add(ident)
            if role == "rollout":
                self._rollout_of[ident] = index
            return True
        if ident not in self._known_idents:
            if msg_type == "error":  # a role that failed before registering; its exit is handled by _watch
                logger.warning("an unregistered peer reported an error: %.500s", p.get("message"))
            self._control_error("unknown_peer", f"dropped {msg_type} from an unregistered peer {ident[:16]!r}")
            return False
        return True

    def _control_error(self, kind: str, text: str, exc_info: bool = False) -> None:
        """Count a refused control message; log at most one per second (a flood must not flood the log)."""
        self.control_errors[kind] += 1
        now = time.monotonic()
        if exc_info or now - self._last_ctl_warn >= 1.0:
            self._last_ctl_warn = now
            logger.warning("controller: %s (%s so far: %s)", text, "refused", dict(self.control_errors),
                           exc_info=exc_info)

    async def _handle(self, ident: bytes, msg_type: str, p: dict) -> None:
        if msg_type == "register":
            key = (str(p["role"]), int(p.get("index", 0)))
            self.peers[key] = ident
            self.last_seen[key] = time.monotonic()
            if key[0] == "inference":
                self.addresses["inference"][key[1]] = p["address"]
            elif key[0] == "learner":
                self.addresses["learner"] = p["address"]
            logger.info("registered %s%d (pid %s)", key[0], key[1], p.get("pid"))
            self._write_addresses()
            restarted = self._restarted_at.pop(f"{key[0]}{key[1]}", None) is not None
            ack: dict[str, Any] = {"ok": True}
            if key[0] == "rollout" and key[1] in self._prompt_positions:
                ack["prompt_position"] = self._prompt_positions[key[1]]
            await self.router.send(ident, "ack", ack)
            if key[0] == "inference" and key[1] in self._rejoining:
                self._restarted_at.pop(self._inference_process(key[1]), None)
                await self._send_rejoin_weights(key[1])
            await self._answer_lookups()
            await self._maybe_start()
            if restarted and key == ("rollout", 0):  # evaluations it was running died with it: ask again
                for v in sorted(self._eval_pending):
                    await self.router.send(ident, "eval", {"version": v, "max_prompts": self.eval_max_prompts})
        elif msg_type == "lookup":
            self._lookups.append(ident)
            await self._answer_lookups()
        elif msg_type == "heartbeat":
            key = (str(p["role"]), int(p.get("index", 0)))
            self.last_seen[key] = time.monotonic()
            self.role_stats[key] = p.get("stats", {})
            pos = self.role_stats[key].get("prompt_position") if key[0] == "rollout" else None
            if isinstance(pos, int):  # a restarted rollout worker continues its prompt stream from here
                self._prompt_positions[key[1]] = max(self._prompt_positions.get(key[1], 0), pos)
        elif msg_type == "gate_acquire":
            self._wants.append([ident, int(p["want"])])
            await self._grant()
        elif msg_type == "group_done":
            index = self._rollout_of.get(ident)
            if index is None or self._held[index] <= 0:
                self._control_error("unexpected_group_done", "dropped a group_done for no running group")
                return
            self._held[index] -= 1
            self.gate.finish(bool(p["accepted"]))
            self._group_reasons[str(p.get("reason"))] += 1
            self._note_traj_stats(p)
            if p.get("traces"):
                self.traces.write(p["traces"])
            if p["accepted"]:
                self.accepted_groups += 1
                self.accepted_trajectories += int(p.get("n_traj", 0))
            await self._grant()
        elif msg_type == "groups_dropped":
            self.gate.drop_accepted(int(p["n"]))
            self._group_reasons["dropped_" + str(p.get("reason", "learner"))] += int(p["n"])
            await self._grant()
        elif msg_type == "weights_published":
            await self._on_published(int(p["version"]), str(p["path"]), p.get("metrics", {}))
        elif msg_type == "weights_loaded":
            await self._on_loaded(int(p["version"]), int(p["index"]))
        elif msg_type == "eval_done":
            await self._on_eval(p)
        elif msg_type == "error":
            key = next((k for k, v in self.peers.items() if v == ident), None)
            if key is not None and key[0] == "rollout" and await self._restart_rollout(
                    f"rollout{key[1]}", f"reported a fatal error: {str(p.get('message'))[:300]}"):
                return
            if key is not None and key[0] == "inference" and key[1] not in self.lost_inference:
                name = self._inference_process(key[1])
                child = self.procs.children.get(name)
                if await self._lose_inference(name, f"reported a fatal error: {p.get('message')}"):
                    if child is not None:  # it may still be alive (a failed handler): make sure it is gone
                        _signal_group(child.proc.pid, signal.SIGKILL)
                    return
            self.fail(f"role reported a fatal error: {p.get('message')}")
        else:
            logger.warning("controller: unexpected message type %s", msg_type)

    async def _answer_lookups(self) -> None:
        if None in self.addresses["inference"] or self.addresses["learner"] is None:
            return
        while self._lookups:
            await self.router.send(self._lookups.pop(), "addresses", dict(self.addresses))

    async def _maybe_start(self) -> None:
        if len(self.peers) == self.num_inference + self.num_rollout + 1 and self.start_version not in self._evals:
            if self.start_version and self.start_version not in self._published:
                # resumed: the learner exported the checkpoint's weights before registering; load them first,
                # the evaluation follows in _check_loaded
                v = self.start_version
                self._published[v] = os.path.join(self.run_dir, "weights", f"v{v}.safetensors")
                logger.info("all roles registered; resuming at version %d", v)
                for i in range(self.num_inference):
                    await self.router.send(self.peers[("inference", i)], "update_weights",
                                           {"version": v, "path": self._published[v]})
                return
            if self.start_version:
                return
            logger.info("all roles registered after %.1fs; evaluating version 0", time.monotonic() - self._t_start)
            await self._request_eval(0)

    async def _grant(self) -> None:
        if not self._training_open:
            return
        while self._wants:
            entry = self._wants[0]
            n = self.gate.try_start(entry[1])
            if n == 0:
                return
            entry[1] -= n
            index = self._rollout_of.get(entry[0])
            if index is not None:
                self._held[index] += n  # returned by group_done, or released as lost if the worker dies
            await self.router.send(entry[0], "gate_grant", {"n": n})
            if entry[1] == 0:
                self._wants.popleft()

    def _note_traj_stats(self, p: dict) -> None:
        """Sum the numeric trajectory metadata a group_done carries (before filters: tool calls, void turns,
        rewards...) until the next train record reports their per-trajectory means."""
        stats, n = p.get("traj_stats"), p.get("n_traj_raw", 0)
        if not isinstance(stats, dict) or not isinstance(n, (int, float)) or n <= 0:
            return
        for k, v in stats.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._traj_sums[str(k)] += float(v)
        self._traj_sums["__n"] += float(n)

    def _take_traj_means(self) -> dict:
        sums, self._traj_sums = self._traj_sums, collections.Counter()
        n = sums.pop("__n", 0.0)
        if not n:
            return {}
        return {"n_traj": int(n), **{k: v / n for k, v in sorted(sums.items())}}

    async def _on_published(self, version: int, path: str, metrics: dict) -> None:
        self._published[version] = path
        self._last_step_metrics = metrics
        for i in range(self.num_inference):
            if i in self.lost_inference:
                continue
            await self.router.send(self.peers[("inference", i)], "update_weights", {"version": version, "path": path})
        now = time.monotonic()
        infer_idle = self._inference_idle_fraction()
        record = {"type": "train", "step": version, "version": version, "elapsed": now - self._t_start,
                  "inference_idle_frac": infer_idle, "groups": dict(self._group_reasons), **metrics,
                  "rollout": self._take_traj_means()}
        self.metrics.write(record)
        self._update_progress(version, metrics)

    def _inference_idle_fraction(self) -> Optional[float]:
        fracs = []
        for (role, idx), st in self.role_stats.items():
            if role != "inference" or "busy_s" not in st:
                continue
            busy, at = float(st["busy_s"]), float(st.get("uptime", 0.0))
            prev = self._infer_busy_prev.get(idx)
            self._infer_busy_prev[idx] = (busy, at)
            if prev and at > prev[1]:
                fracs.append(1.0 - min(1.0, (busy - prev[0]) / (at - prev[1])))
        return sum(fracs) / len(fracs) if fracs else None

    async def _on_loaded(self, version: int, index: int) -> None:
        if index in self._rejoining:  # a restarted server caught up: rejoin, unless a newer version came out since
            if self._published and version < max(self._published):
                await self._send_rejoin_weights(index)
                return
            self._loaded[version].add(index)
            await self._rejoin(index)
            return
        self._loaded[version].add(index)
        await self._check_loaded(version)

    async def _check_loaded(self, version: int) -> None:
        """Version `version` is live once every inference server not lost has acked it."""
        alive = set(range(self.num_inference)) - self.lost_inference
        if (version == self.start_version and self.start_version and alive <= self._loaded[version]
                and version not in self._evals):
            await self._request_eval(version)  # resumed run: the checkpoint's weights are live everywhere
            return
        if not alive <= self._loaded[version] or version <= self.gate.version:
            return
        self.gate.set_version(version)
        await self._grant()
        if version >= self.total_steps or (self.eval_every and version % self.eval_every == 0):
            await self._request_eval(version)

    async def _request_eval(self, version: int) -> None:
        self._eval_pending.add(version)
        self._evals[version] = {}
        ident = self.peers.get(("rollout", 0))
        if ident is None:  # rollout0 is being restarted: it gets the pending evaluations when it registers
            return
        await self.router.send(ident, "eval", {"version": version, "max_prompts": self.eval_max_prompts})

    async def _on_eval(self, p: dict) -> None:
        version = int(p["version"])
        self._eval_pending.discard(version)
        self._evals[version] = p
        roles = {f"{r}{i}": st for (r, i), st in sorted(self.role_stats.items())}
        self.metrics.write({"type": "eval", "step": version, "elapsed": time.monotonic() - self._t_start, **p,
                            "roles": roles})
        self.report.request()  # rebuilt in a thread: the controller's loop goes on
        msg = (f"eval v{version}: first-answer acc {p['first_acc']:.3f}, solved within all turns "
               f"{p['solved_acc']:.3f} ({p['n']} prompts, {p.get('seconds', 0):.1f}s)")
        logger.info(msg)
        if self._bar is not None:
            self._bar.write(msg)
        if version == self.start_version and not self._training_open:
            self._training_open = True
            await self._grant()
        if version >= self.total_steps and not self._eval_pending:
            self._done.set()

    def _update_progress(self, version: int, metrics: dict) -> None:
        if not self._progress:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total_steps, desc="train", dynamic_ncols=True, file=sys.stderr)
        last_eval = max((v for v, e in self._evals.items() if e), default=None)
        acc = self._evals[last_eval]["first_acc"] if last_eval is not None else float("nan")
        self._bar.set_postfix(v=version, reward=f"{metrics.get('reward_mean', float('nan')):.3f}",
                              acc=f"{acc:.3f}", stale=metrics.get("head_offpolicyness"), refresh=False)
        self._bar.update(version - self._bar.n)

    async def _await_learner_accounting(self, timeout: float) -> None:
        """Give the learner's heartbeat (1 s) a moment to catch up with the groups accepted so far, so the final
        accounting compares counts taken at (nearly) the same time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = self.role_stats.get(("learner", 0), {})
            caught_up = (int(st.get("groups_received", -1)) >= self.accepted_groups
                         and int(st.get("version", -1)) >= self.gate.version and not st.get("in_step_groups"))
            if caught_up and (self._failure is not None or not self.gate.running):
                return
            await asyncio.sleep(0.2)

    def accounting(self) -> dict:
        """Where every accepted group went: the controller's counts next to the learner's latest snapshot, plus
        faults handled and malformed input dropped. `lost_accepted_groups` and `trained_twice` must stay 0."""
        ls = self.role_stats.get(("learner", 0), {})
        learner = {k: ls.get(k) for k in ("groups_received", "trajectories_received", "trained_groups",
                                          "trained_trajectories", "stale_groups_dropped", "stale_trajectories_dropped",
                                          "invalid_groups", "buffered_groups", "buffered_trajectories",
                                          "in_step_groups", "trained_twice")}
        transport = {"controller": dict(self.router.stats) if self.router is not None else {},
                     "controller_refused": dict(self.control_errors)}
        for (role, index), st in sorted(self.role_stats.items()):
            if isinstance(st.get("transport"), dict):
                transport[f"{role}{index}"] = st["transport"]
        env = collections.Counter(self._env_of_restarted)
        for (role, _), st in self.role_stats.items():
            if role == "rollout":
                env.update({k: v for k, v in dict(st.get("env") or {}).items() if k != "env_calls_in_flight"})
        out = {"finished": self._failure is None and self.gate.version >= self.total_steps,
               "failure": (self._failure or "")[:2000], "steps": self.gate.version,
               "groups": dict(self._group_reasons), "accepted_groups": self.accepted_groups,
               "accepted_trajectories": self.accepted_trajectories, "lost_in_flight_groups": self.lost_groups,
               "running_groups": self.gate.running, "rollout_restarts": self.restarts,
               "inference_restarts": self.inference_restarts, "learner": learner,
               "env": dict(env), "transport": transport, "faults": list(self.faults)}
        if ls:
            received = int(ls.get("groups_received") or 0)
            out["lost_accepted_groups"] = max(0, self.accepted_groups - received)
            out["learner_balance"] = received - sum(int(ls.get(k) or 0) for k in (
                "trained_groups", "stale_groups_dropped", "buffered_groups", "in_step_groups"))  # invalid: not received
        return out

    def summary(self) -> dict:
        evals = {v: e for v, e in self._evals.items() if e}
        return {
            "run_dir": self.run_dir,
            "steps": self.gate.version,
            "evals": {v: (e["first_acc"], e["solved_acc"]) for v, e in sorted(evals.items())},
            "groups": dict(self._group_reasons),
            "lost_inference": sorted(self.lost_inference),
            "seconds": time.monotonic() - self._t_start,
        }
