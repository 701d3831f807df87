"""Supervision of the role processes: who is alive, who went silent, which failure restarts what.

Two halves. `RoleLauncher` is what the controller needs from whatever runs the processes (`LocalLauncher`: OS
processes, in arl.launch.local; `RayLauncher`: processes on Ray nodes, in arl.launch.ray). `Supervisor` is the
decision logic, pure and clocked by the caller: heartbeats and registration deadlines, and for a failed role
whether the run restarts it, goes on without it, or stops.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence

from arl.utils.net import free_port

from arl.transport.messages import ROLES


def process_role(name: str) -> Optional[tuple[str, int]]:
    """('inference', 3) for process 'inference3', ('learner', 0) for 'learner' (and ('learner', 2) for 'learner2', a
    trainable listed policy's); None for a name that is not a role process's. The one parser of the names
    `Supervisor.process_of` makes (the launchers' hosts use it too)."""
    if name == "learner":
        return "learner", 0
    for role in ("inference", "rollout", "env", "judge", "learner"):
        tail = name[len(role):]
        if name.startswith(role) and tail.isdigit() and (role != "learner" or tail[0] != "0"):  # 'learner0': no
            return role, int(tail)
    return None


class RoleLauncher(Protocol):
    """Starts and stops role processes by name (e.g. 'rollout1'); everything blocking may run in a thread."""

    #: True: every learner rank is a process the launcher places itself (Ray); False: the controller starts the
    #: learner under torchrun, which starts the ranks
    runs_ranks: bool
    #: extra environment of every role process (the run's shared secret), set before the first spawn
    env: dict[str, str]
    #: (optional, default False) the launcher has `add`, `remove` and `fits`: roles join and leave a running run
    #: (`arl.ctl scale`)

    def spawn(self, name: str, argv: Sequence[str], log_path: str) -> None: ...

    # elastic launchers only:
    #   add(name, argv, log_path): start a role mid-run without blocking the caller (the controller's event loop);
    #     one that cannot be placed does not register within startup_timeout, and `pending` says why
    #   remove(name): stop a role that left the run (an expected exit) and give back what it held (Ray: its
    #     placement group, so its node's resources are free again)
    #   fits(role, index) -> str: why a new `role` `index` could never be placed ('' : it could)

    def abort(self) -> None:
        """Ctrl-C during start-up: end a wait in `spawn` now (it raises) and refuse further spawns."""

    def respawn(self, name: str) -> None:
        """Start `name` again with its argv and log; the caller killed it and saw it exit (a hung one)."""

    def kill(self, name: str) -> None:
        """Kill `name` now if it runs; its exit is expected (not reported by `dead`)."""

    def dead(self) -> list[tuple[str, Optional[int]]]:
        """(name, exit code) of processes that exited without being asked to."""

    def has(self, name: str) -> bool: ...

    def alive(self, name: str) -> bool: ...

    def log_path(self, name: str) -> str: ...

    def stack_dump(self, name: str, wait: float) -> tuple[str, str]:
        """(process state, dumped Python stacks or '') of a running role: for a silent one's post-mortem."""

    def expect_exit(self) -> None: ...

    def wait_all(self, timeout: float) -> bool: ...

    def terminate_all(self, grace: float) -> None: ...

    def where(self, name: str) -> dict[str, Any]:
        """Where process `name` runs, for its `role_placed` record ({} when there is nothing to say: one host)."""

    def pending(self, name: str) -> str:
        """Why process `name`, (re)started, is not running yet, in plain words ('' when there is nothing to say):
        Ray's restart waiting for resources. Never waits (the controller's event loop calls it)."""

    def close(self) -> None:
        """The run is over: release what the launcher holds beyond its processes (Ray: actors, placement groups,
        the connection). Called once, after `terminate_all`."""


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do about a failed process: 'restart_rollout', 'restart_env' (an env server or a judge worker),
    'restart_learner' (from its newest checkpoint), 'lose_inference' (drop its `servers` from the run and `restart`
    it) or 'fatal'."""

    action: str
    restart: bool = False
    servers: tuple[int, ...] = ()
    note: str = ""  # why a restart was refused, for the log


def _restart_or_stop(done: int, cap: int, what: str, action: str, registered: bool, spawned: bool) -> Decision:
    """A process the run restarts (rollout worker, env server, judge worker): restarted under its cap, unless it
    never registered (a restart would fail the same way) or the launcher did not start it."""
    if done >= cap:
        return Decision("fatal", note=f"the run already restarted {done} {what}")
    if not registered:
        return Decision("fatal", note="it failed before it registered; not restarting it")
    return Decision(action if spawned else "fatal", restart=spawned)


class Supervisor:
    """Heartbeats, registration deadlines and the restart policy of one run. Pure: `now` comes from the caller.

    Roles are keyed (role, index); processes are named 'inference<p>' (hosting servers p*k..p*k+k-1 with k =
    `servers_per_process`), 'learner' and 'rollout<i>'.
    """

    def __init__(self, *, num_inference: int, num_rollout: int, servers_per_process: int = 1,
                 startup_timeout: float, heartbeat_timeouts: Optional[dict[str, float]] = None,
                 tolerate_inference_loss: bool = False, restart_rollout: bool = True, max_restarts: int = 3,
                 restart_inference: bool = False, max_inference_restarts: int = 3, num_env: int = 0,
                 max_env_restarts: int = 3, num_judge: int = 0, max_judge_restarts: int = 3,
                 max_learner_restarts: int = 3, num_policy_learners: int = 0) -> None:
        """`num_judge`: judge workers (`arl.inference.entry.run_judge`): frozen, never in the weight sync;
        restarted like env servers, under `max_judge_restarts`. `max_learner_restarts`: a lost learner is
        restarted from its newest checkpoint this often (0: a lost learner stops the run). `num_policy_learners`:
        the learners of trainable listed policies (`learner1` ..): never restarted (a lost one stops the run)."""
        self.num_policy_learners = num_policy_learners
        self.num_inference, self.num_rollout, self.num_env = num_inference, num_rollout, num_env
        self.num_judge, self.max_judge_restarts, self.judge_restarts = num_judge, max_judge_restarts, 0
        self.servers_per_process = max(1, servers_per_process)
        self.startup_timeout = startup_timeout
        self.heartbeat_timeouts = {r: 120.0 for r in ROLES} | dict(heartbeat_timeouts or {})  # per role
        # tolerate_inference_loss: an inference process that dies (or stops heartbeating) is dropped instead of
        # failing the run, while another server remains; rollout workers re-send its requests elsewhere
        self.tolerate_inference_loss = tolerate_inference_loss
        self.restart_rollout, self.max_restarts = restart_rollout, max_restarts
        self.restart_inference, self.max_inference_restarts = restart_inference, max_inference_restarts
        self.restarts = self.inference_restarts = self.env_restarts = 0
        self.max_env_restarts = max_env_restarts
        self.max_learner_restarts, self.learner_restarts = max_learner_restarts, 0
        self.last_seen: dict[tuple[str, int], float] = {}
        self.restarted_at: dict[str, float] = {}  # process name -> when it was restarted (until it registers)
        self.started_at: Optional[float] = None
        self.all_up = False  # every role registered once (later gaps are restarts, timed by restarted_at)
        # role -> indices scaled out of the run, or added and given up (indices are never reused)
        self.retired: dict[str, set[int]] = {"inference": set(), "rollout": set(), "env": set()}
        self.joining: set[str] = set()  # processes added mid-run (`arl.ctl scale`) that have not registered yet

    # -- names -----------------------------------------------------------------------------------------------
    @property
    def expected(self) -> int:
        """Registrations of a complete run: every inference server, the learner, every rollout worker and env
        server."""
        return (self.num_inference + self.num_rollout + self.num_env + self.num_judge + 1 + self.num_policy_learners
                - sum(len(r) for r in self.retired.values()))

    COUNTS = {"inference": "num_inference", "rollout": "num_rollout", "env": "num_env", "judge": "num_judge"}

    def live(self, role: str) -> list[int]:
        """The indices of `role` in the run now (those scaled out, or added and given up, are not)."""
        gone = self.retired.get(role, ())
        return [i for i in range(getattr(self, self.COUNTS[role])) if i not in gone]

    def rollouts(self) -> list[int]:
        return self.live("rollout")

    def process_of(self, role: str, index: int) -> str:
        if role == "inference":
            return f"inference{index // self.servers_per_process}"
        return "learner" if (role, index) == ("learner", 0) else f"{role}{index}"

    def commands(self, python: str, run_dir: str, controller: str, learner_ranks: int = 1,
                 torchrun: bool = True) -> list[tuple[str, list[str]]]:
        """(process name, argv) of every role process of the run (`arl.launch.role`). Learner ranks > 1 run under
        torchrun unless the launcher starts each rank itself (`torchrun=False`): rank 0 registers and talks to the
        controller, the others follow it (`arl.learner.ranks`)."""
        def cmd(role: str, i: int) -> list[str]:
            return self.command(python, run_dir, controller, role, i)

        k = self.servers_per_process
        # process i hosts servers i*k..i*k+k-1
        out = [(f"inference{i}", cmd("inference", i)) for i in range(-(-self.num_inference // k))]
        learner = cmd("learner", 0)
        if learner_ranks > 1 and torchrun:
            learner = [python, "-m", "torch.distributed.run", "--nproc_per_node", str(learner_ranks),
                       "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", *learner[2:]]
        out.append(("learner", learner))
        out += [(f"learner{k}", cmd("learner", k)) for k in range(1, self.num_policy_learners + 1)]
        out += [(f"env{i}", cmd("env", i)) for i in range(self.num_env)]
        out += [(f"judge{i}", cmd("judge", i)) for i in range(self.num_judge)]
        return out + [(f"rollout{i}", cmd("rollout", i)) for i in range(self.num_rollout)]

    @staticmethod
    def command(python: str, run_dir: str, controller: str, role: str, index: int) -> list[str]:
        """The argv of process `index` of `role` (`arl.launch.role`)."""
        return [python, "-m", "arl.launch.role", "--run-dir", run_dir, "--controller", controller, "--role", role,
                "--index", str(index)]

    def servers_of(self, name: str) -> list[int]:
        """Server indices hosted by process `name` ('inference<p>'); [] for other roles."""
        parsed = process_role(name)
        if parsed is None or parsed[0] != "inference":
            return []
        first = parsed[1] * self.servers_per_process
        return list(range(first, min(self.num_inference, first + self.servers_per_process)))

    @staticmethod
    def rollout_index(name: str) -> Optional[int]:
        parsed = process_role(name)
        return parsed[1] if parsed is not None and parsed[0] == "rollout" else None

    @staticmethod
    def env_index(name: str) -> Optional[int]:
        parsed = process_role(name)
        return parsed[1] if parsed is not None and parsed[0] == "env" else None

    @staticmethod
    def judge_index(name: str) -> Optional[int]:
        parsed = process_role(name)
        return parsed[1] if parsed is not None and parsed[0] == "judge" else None

    # -- liveness --------------------------------------------------------------------------------------------
    def heard(self, key: tuple[str, int], now: float) -> None:
        self.last_seen[key] = now

    def forget(self, key: tuple[str, int]) -> None:
        self.last_seen.pop(key, None)

    def registered(self, key: tuple[str, int], now: float, registrations: int) -> bool:
        """`key` registered (now `registrations` in all); True if its process was a restart being waited for."""
        self.heard(key, now)
        self.all_up = self.all_up or registrations >= self.expected
        self.joining.discard(self.process_of(*key))
        return self.restarted_at.pop(self.process_of(*key), None) is not None

    def silent(self, now: float) -> list[tuple[tuple[str, int], float]]:
        """(role key, when last heard) of every role past its heartbeat timeout."""
        return [(k, t) for k, t in list(self.last_seen.items()) if now - t > self.heartbeat_timeouts[k[0]]]

    def late(self, now: float) -> list[str]:
        """Restarted processes that did not register within `startup_timeout`."""
        return [n for n, t in self.restarted_at.items() if now - t > self.startup_timeout]

    def deadlines(self, now: float, processes: Sequence[str],
                  registered: Callable[[str], bool]) -> tuple[list[str], str]:
        """Registration deadlines at `now`: (restarted inference processes that did not come back, to give up on:
        the run goes on without them; the reason to stop the run, or ''). `processes`: those the run started,
        `registered(name)`: a role it hosts registered."""
        late = self.late(now)
        given_up = [n for n in late if self.servers_of(n) or n in self.joining]  # the run goes on without them
        late = [n for n in late if n not in given_up]
        if late:
            return given_up, f"restarted roles did not register within {self.startup_timeout}s: {late}"
        if self.startup_overdue(now):
            missing = [n for n in processes if not registered(n)]
            return given_up, f"roles did not register within {self.startup_timeout}s: {missing}"
        return given_up, ""

    def startup_overdue(self, now: float) -> bool:
        """The run's roles did not all register within `startup_timeout` of the first check."""
        if self.started_at is None:
            self.started_at = now
        return not self.all_up and now - self.started_at > self.startup_timeout

    # -- failures --------------------------------------------------------------------------------------------
    def decide(self, name: str, *, registered: bool, lost: set[int], rejoining: set[int] = frozenset(),
               spawned: bool = True) -> Decision:
        """What a failure (death, silence, reported error) of process `name` means for the run; `registered`: its
        role had registered, `lost`: inference servers out of the run (`rejoining`: restarted ones not back yet),
        `spawned`: the launcher started it (so it can start it again)."""
        if name in self.joining:  # added mid-run (arl.ctl scale): not restarted, not fatal; the run goes on
            return Decision("give_up", note="it was added mid-run and exited before it registered")
        if self.rollout_index(name) is not None and self.restart_rollout:
            return _restart_or_stop(self.restarts, self.max_restarts, "rollout workers (max_restarts)",
                                    "restart_rollout", registered, spawned)
        if self.env_index(name) is not None:  # an env server: restarted like a rollout worker, under its own cap
            return _restart_or_stop(self.env_restarts, self.max_env_restarts, "env servers (env.max_restarts)",
                                    "restart_env", registered, spawned)
        if self.judge_index(name) is not None:  # a judge worker: the same, under judge.inference.max_restarts
            return _restart_or_stop(self.judge_restarts, self.max_judge_restarts,
                                    "judge workers (judge.inference.max_restarts)", "restart_env", registered,
                                    spawned)
        parsed = process_role(name)
        if parsed is not None and parsed[0] == "learner" and self.max_learner_restarts > 0:
            if parsed[1]:  # a trainable listed policy's learner: from its own newest checkpoint
                return _restart_or_stop(self.learner_restarts, self.max_learner_restarts,
                                        "learners (learner.max_restarts)", "restart_policy_learner", registered,
                                        spawned)
            if self.num_policy_learners:  # its rollback would leave the other policies' learners behind
                return Decision("fatal", note="a run with trainable listed policies does not restart its own "
                                              "learner (the run's rollback to its checkpoint is not built for them)")
            return _restart_or_stop(self.learner_restarts, self.max_learner_restarts,
                                    "learners (learner.max_restarts)", "restart_learner", registered, spawned)
        hosted = self.servers_of(name)
        remaining = set(range(self.num_inference)) - lost - set(hosted)
        if hosted and self.tolerate_inference_loss and self.all_up:
            # a restarted process that dies before it rejoined is lost again (and may be restarted again)
            servers = tuple(s for s in hosted if s not in lost or s in rejoining)
            restart = (self.restart_inference and self.inference_restarts < self.max_inference_restarts
                       and spawned and bool(servers))
            # the last server(s) too, when restarted: generation waits (rollout clients hold their requests)
            # until it is back; without a restart the run would have none left
            if remaining or restart:
                return Decision("lose_inference", restart=restart, servers=servers)
        return Decision("fatal")

    def restarting(self, name: str, now: float) -> int:
        """Count a restart of `name` (its registration is timed from `now`); returns the new count for its kind."""
        self.restarted_at[name] = now
        if self.servers_of(name):
            self.inference_restarts += 1
            return self.inference_restarts
        if self.env_index(name) is not None:
            self.env_restarts += 1
            return self.env_restarts
        if self.judge_index(name) is not None:
            self.judge_restarts += 1
            return self.judge_restarts
        if (process_role(name) or ("",))[0] == "learner":
            self.learner_restarts += 1
            return self.learner_restarts
        self.restarts += 1
        return self.restarts

    def gave_up(self, name: str) -> list[tuple[str, int]]:
        """Restarted (or added) process `name` did not come back; returns the roles of one added mid-run, which
        are not of the run any more (the caller retires them: `Peers.retire`)."""
        self.restarted_at.pop(name, None)
        if name not in self.joining:
            return []
        self.joining.discard(name)
        parsed = process_role(name)
        if parsed and parsed[0] == "inference":
            return [("inference", s) for s in self.servers_of(name)]
        return [parsed] if parsed else []
