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
from typing import Any, Optional

from arl.launcher.process import ProcessGroup, _signal_group, tail
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
        self.resume = dict(resume or {})
        self.start_version = int(self.resume.get("version", 0))
        if self.start_version:
            self.gate.version = self.start_version
            self.gate.accepted = int(self.resume.get("groups_consumed", self.start_version * batch_size))
        self._prompt_positions = {int(k): int(v) for k, v in dict(self.resume.get("data_position", {})).items()}
        self.procs = ProcessGroup()
        self.metrics = MetricsWriter(os.path.join(run_dir, "metrics.jsonl"))
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
        self._progress = progress
        self._bar: Any = None
        self._t_start = time.monotonic()
        self._infer_busy_prev: dict[int, tuple[float, float]] = {}

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def bind(self) -> str:
        self.router = Router()
        self.address = bind_random(self.router)
        return self.address

    def spawn_roles(self, python: str = sys.executable) -> None:
        base = [python, "-m", "arl.launcher.worker", "--run-dir", self.run_dir, "--controller", self.address]
        logs = os.path.join(self.run_dir, "logs")
        for i in range(-(-self.num_inference // self.servers_per_process)):  # process i hosts servers i*k..i*k+k-1
            self.procs.spawn(f"inference{i}", base + ["--role", "inference", "--index", str(i)],
                             os.path.join(logs, f"inference{i}.log"))
        self.procs.spawn("learner", base + ["--role", "learner", "--index", "0"], os.path.join(logs, "learner.log"))
        for i in range(self.num_rollout):
            self.procs.spawn(f"rollout{i}", base + ["--role", "rollout", "--index", str(i)],
                             os.path.join(logs, f"rollout{i}.log"))

    async def run(self) -> dict:
        """Run until the learner finished `total_train_steps` and the final evaluation is in."""
        tasks = [asyncio.create_task(self._serve()), asyncio.create_task(self._watch())]
        try:
            await self._done.wait()
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
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

    def fail(self, message: str) -> None:
        if self._failure is None:
            self._failure = message
        self._done.set()

    # -- watching ----------------------------------------------------------------------------------------------
    async def _watch(self) -> None:
        started = time.monotonic()
        while True:
            await asyncio.sleep(0.2)
            for child in self.procs.dead():
                code = child.proc.returncode
                if await self._lose_inference(child.name, f"exited with code {code}"):
                    continue
                self.fail(
                    f"role {child.name} exited with code {code}; last lines of {child.log_path}:\n"
                    f"{tail(child.log_path, 25)}"
                )
                return
            registered = len(self.peers)
            expected = self.num_inference + self.num_rollout + 1
            if registered < expected and time.monotonic() - started > self.startup_timeout:
                missing = [c.name for c in self.procs.children.values() if not self._is_registered(c.name)]
                self.fail(f"roles did not register within {self.startup_timeout}s: {missing}")
                return
            now = time.monotonic()
            for key, seen in list(self.last_seen.items()):
                if now - seen > self.heartbeat_timeout:
                    if key[0] == "inference" and self._can_lose_inference(self._inference_process(key[1])):
                        name = self._inference_process(key[1])
                        child = self.procs.children.get(name)
                        if child is not None:  # hung: kill it so it cannot come back half-alive
                            child.expected_exit = True
                            _signal_group(child.proc.pid, signal.SIGKILL)
                        await self._lose_inference(name, f"sent no heartbeat for {now - seen:.0f}s")
                        continue
                    self.fail(f"role {key[0]}{key[1]} sent no heartbeat for {now - seen:.0f}s")
                    return

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
        servers = [s for s in self._inference_servers(name) if s not in self.lost_inference]
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
        for r in range(self.num_rollout):
            ident = self.peers.get(("rollout", r))
            if ident is not None:
                await self.router.send(ident, "worker_lost", {"role": "inference", "indices": servers})
        for v in sorted(self._published):  # a version only the lost worker had not acked is complete now
            await self._check_loaded(v)
        return True

    def _is_registered(self, name: str) -> bool:
        return any(f"{r}{i}" == name or (r == "learner" and name == "learner") for r, i in self.peers)

    # -- message handling --------------------------------------------------------------------------------------
    async def _serve(self) -> None:
        assert self.router is not None
        while True:
            ident, msg_type, payload = await self.router.recv()
            try:
                await self._handle(ident, msg_type, payload)
            except Exception as e:  # noqa: BLE001 - a bad control message must not kill the controller
                logger.exception("controller: error handling %s: %s", msg_type, e)

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
            ack: dict[str, Any] = {"ok": True}
            if key[0] == "rollout" and key[1] in self._prompt_positions:
                ack["prompt_position"] = self._prompt_positions[key[1]]
            await self.router.send(ident, "ack", ack)
            await self._answer_lookups()
            await self._maybe_start()
        elif msg_type == "lookup":
            self._lookups.append(ident)
            await self._answer_lookups()
        elif msg_type == "heartbeat":
            key = (str(p["role"]), int(p.get("index", 0)))
            self.last_seen[key] = time.monotonic()
            self.role_stats[key] = p.get("stats", {})
        elif msg_type == "gate_acquire":
            self._wants.append([ident, int(p["want"])])
            await self._grant()
        elif msg_type == "group_done":
            self.gate.finish(bool(p["accepted"]))
            self._group_reasons[str(p.get("reason"))] += 1
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
            await self.router.send(entry[0], "gate_grant", {"n": n})
            if entry[1] == 0:
                self._wants.popleft()

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
                  "inference_idle_frac": infer_idle, "groups": dict(self._group_reasons), **metrics}
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
        await self.router.send(self.peers[("rollout", 0)], "eval", {"version": version,
                                                                    "max_prompts": self.eval_max_prompts})

    async def _on_eval(self, p: dict) -> None:
        version = int(p["version"])
        self._eval_pending.discard(version)
        self._evals[version] = p
        roles = {f"{r}{i}": st for (r, i), st in sorted(self.role_stats.items())}
        self.metrics.write({"type": "eval", "step": version, "elapsed": time.monotonic() - self._t_start, **p,
                            "roles": roles})
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
