"""`launcher=ray`: every role process runs on a Ray node; the controller stays in the driver.

Each role (an inference process, a rollout worker, each learner rank) gets a placement group whose bundle says what
it needs (CPUs, GPUs, and the custom resources that pick its nodes) and a small actor (`RoleHost`) placed in that
bundle. The actor starts the role's usual entry point (`python -m arl.launch.role ...`) as a subprocess on its
node with the local launcher's code (`LocalLauncher`: spawn, kill, terminate, stack dump) and waits for it, so
the roles' code is the same as with the local launcher. Why a subprocess and not the role inside the actor: kill,
restart, stack dumps and exit codes then work exactly as locally, and a role that dies takes nothing of Ray's with
it. The subprocess dies with its actor (PR_SET_PDEATHSIG), so killing the actor (ray.kill, the driver's job ending,
the node going away) leaves no role process behind.

What travels through Ray and nowhere else: the run's shared secret and each role's bind address (environment of
the subprocess, as a method argument of its actor), the learner ranks' rendezvous (rank 0's node address and a port
free there), config.yaml for a node without the run directory, and the roles' logs: a thread in the driver copies
each role's node-local log into run_dir/logs as it grows, and once more when the role ends.

Ray is imported only here, and this module only when `launcher=ray`.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import os
import sys
import tempfile
import threading
import time
from typing import Any, Collection, Mapping, Optional, Sequence

from arl.controller.shell import RunFailed
from arl.controller.supervision import process_role
from arl.launch.local import LocalLauncher

logger = logging.getLogger("arl.launch")

__all__ = ["RayLauncher", "RoleHost", "RolePlacementError", "bundle_for", "describe_pending"]

_LOG_CHUNK = 1 << 20
_COPY_ROUNDS = 8  # chunks one pump round copies per role: up to 8 MiB per role per round
FINAL_LOG_MAX = 64 << 20  # a role's end: at most this much of what its node still holds is copied (the newest)
PYTHON = "{python}"  # in a role's argv: the Python of its node's Ray workers (the driver's may live elsewhere)
_NOT_CUSTOM = ("CPU", "GPU", "memory", "object_store_memory")
_NODE_ID_LABEL = "ray.io/node-id"  # the label Ray gives every node: its id
PENDING_NOTICE_S = 3.0  # a restart not placed this long after it was asked for is said on the console, with why
# Ray's scheduling state of a pending placement group (`placement_group_table`'s stats), in plain words
_SCHEDULING = {"INFEASIBLE": "no live node has that much, even idle",
               "NO_RESOURCES": "no live node has that much free now",
               "QUEUED": "queued behind other placement groups"}


_HOW_TO_FIT = ("Ray's CPUs are scheduling tokens, not cores: lower ray.cpus_per_inference, ray.cpus_per_rollout or "
               "ray.cpus_per_learner_rank (fractions such as 0.5 work), raise ray.num_cpus (ray.address=local), "
               "change ray.placement, or add nodes.")


class RolePlacementError(RunFailed):
    """A role's placement group could not be placed within the startup timeout (not enough resources)."""


class RoleHost:
    """Ray actor (threaded) that runs one role process on its node with the local launcher's code (spawn, kill,
    terminate, stack dump): `run` starts it and returns its exit code; the other methods work while `run` waits."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.procs = LocalLauncher()
        self.log_path = os.path.join(tempfile.gettempdir(), f"arl-ray-{os.getpid()}", f"{name}.log")
        self._started = threading.Event()

    def where(self) -> dict[str, Any]:
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address()}

    def free_port(self) -> int:
        from arl.utils.net import free_port

        return free_port()

    def run(self, argv: Sequence[str], env: Mapping[str, str], files: Mapping[str, bytes]) -> int:
        """Start the role (`files`: absolute path -> content, written where missing: the run's config.yaml on a node
        without the run directory) and return its exit code when it exits."""
        import ray

        try:
            for path, data in files.items():
                if not os.path.exists(path):
                    os.makedirs(os.path.dirname(path), exist_ok=True)
                    with open(path, "wb") as f:
                        f.write(data)
            self.procs.env = {"ARL_BIND_HOST": ray.util.get_node_ip_address(), **env}
            self.procs.spawn(self.name, [sys.executable if a == PYTHON else a for a in argv], self.log_path)
        finally:
            self._started.set()
        return self.procs.children[self.name].proc.wait()

    def pid(self) -> int:
        self._started.wait(30.0)
        child = self.procs.children.get(self.name)
        return child.proc.pid if child is not None else -1

    def read_log(self, offset: int) -> bytes:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(offset)
                return f.read(_LOG_CHUNK)
        except FileNotFoundError:
            return b""

    def log_size(self) -> int:
        try:
            return os.path.getsize(self.log_path)
        except OSError:
            return 0

    def discard_log(self) -> None:
        """The driver has the whole log: remove the node-local copy (a role process must have ended)."""
        import shutil

        if not self.procs.alive(self.name):
            shutil.rmtree(os.path.dirname(self.log_path), ignore_errors=True)

    def kill(self) -> None:
        self._started.wait(30.0)  # a kill sent right after the start may overtake `run` (another actor thread)
        self.procs.kill(self.name)

    def terminate(self, grace: float) -> None:
        self._started.wait(30.0)
        self.procs.terminate_all(grace)

    def stack_dump(self, wait: float) -> tuple[str, str]:
        return self.procs.stack_dump(self.name, wait)


def bundle_for(ray_cfg: Any, role: str, index: int, servers_per_process: int = 1) -> dict[str, float]:
    """The placement bundle of process `index` of `role` (for the learner: rank `index`): CPUs and GPUs from
    `ray.*_per_*`, plus the custom resources `ray.placement[role]` names (a map for every process of the role, or
    a list of maps, one per process index, the last one repeating)."""
    if role in ("inference", "judge"):  # a judge worker is an inference server of the judge model
        cpus, gpus = ray_cfg.cpus_per_inference, ray_cfg.gpus_per_inference * servers_per_process
    elif role == "learner":
        cpus, gpus = ray_cfg.cpus_per_learner_rank, ray_cfg.gpus_per_learner_rank
    elif role == "env":
        cpus, gpus = ray_cfg.cpus_per_env, 0.0
    else:
        cpus, gpus = ray_cfg.cpus_per_rollout, 0.0
    bundle: dict[str, float] = {"CPU": float(cpus)}
    if gpus:
        bundle["GPU"] = float(gpus)
    spec = dict(ray_cfg.placement or {}).get(role) or {}
    if isinstance(spec, (list, tuple)) or (hasattr(spec, "__len__") and not hasattr(spec, "keys")):
        spec = list(spec)[min(index, len(spec) - 1)] if len(spec) else {}
    for key, amount in dict(spec).items():
        bundle[str(key)] = float(amount)
    if not bundle["CPU"]:
        del bundle["CPU"]
    return bundle


def planned_bundles(ray_cfg: Any, processes: Optional[Mapping[str, int]], learner_ranks: int = 1,
                    servers_per_process: int = 1) -> list[tuple[str, dict[str, float]]]:
    """(process name, bundle) of every process a run with `processes` ({'inference': 2, 'rollout': 1}) starts: the
    inference processes, the learner's ranks, the rollout workers. [] when `processes` is not known."""
    if not processes:
        return []
    out = [(f"inference{i}", bundle_for(ray_cfg, "inference", i, servers_per_process))
           for i in range(int(processes.get("inference", 0)))]
    out += [("learner" if r == 0 else f"learner-rank{r}", bundle_for(ray_cfg, "learner", r))
            for r in range(max(1, learner_ranks))]
    out += [(f"rollout{i}", bundle_for(ray_cfg, "rollout", i)) for i in range(int(processes.get("rollout", 0)))]
    out += [(f"env{i}", bundle_for(ray_cfg, "env", i)) for i in range(int(processes.get("env", 0)))]
    out += [(f"judge{i}", bundle_for(ray_cfg, "judge", i)) for i in range(int(processes.get("judge", 0)))]
    return out


def local_cpus(ray_cfg: Any, plan: Sequence[tuple[str, dict[str, float]]]) -> int:
    """CPUs a Ray started for the run (`address=local`) declares: `ray.num_cpus`, else this machine's cores but at
    least what the run's bundles ask for. Ray's CPUs are scheduling tokens, not cores: the roles set their own
    thread counts, and on a 2-core machine the default run's three one-CPU bundles must still be placed."""
    if ray_cfg.num_cpus:
        return int(ray_cfg.num_cpus)
    need = sum(b.get("CPU", 0.0) for _, b in plan)
    return max(os.cpu_count() or 1, math.ceil(need - 1e-9))


def plain_resources(resources: Mapping[str, float]) -> str:
    """'2 CPU, 1 GPU, 1 node_a': what a user configures, without Ray's internal names (placement groups'
    `CPU_group_<id>`, `node:<ip>`, memory)."""
    keep = {k: v for k, v in resources.items()
            if "_group_" not in k and not k.startswith(("node:", "accelerator_type:"))
            and k not in ("memory", "object_store_memory")}
    order = sorted(keep, key=lambda k: (k not in ("CPU", "GPU"), k != "CPU", k))
    return ", ".join(f"{keep[k]:g} {k}" for k in order) or "nothing"


def describe_pending(name: str, bundles: Sequence[Mapping[str, float]], state: str,
                     nodes: Sequence[tuple[str, Mapping[str, float], Optional[Mapping[str, float]]]]) -> str:
    """Why `name`'s placement group waits, in plain words: what it asks, Ray's scheduling state, and what each
    live node has (`nodes`: (label, resources in all, resources free or None when unknown))."""
    def node(label: str, total: Mapping[str, float], free: Optional[Mapping[str, float]]) -> str:
        has = plain_resources(total)
        if free is None:
            return f"{label} {has}"
        return f"{label} {has} ({plain_resources({k: free.get(k, 0.0) for k in total})} free)"

    asked = " and ".join(plain_resources(b) for b in bundles)
    said = f"{state} ({_SCHEDULING[state]})" if state in _SCHEDULING else (state or "nothing")
    each = " | ".join(node(*n) for n in nodes) or "no live node"
    return (f"{name} is waiting to be placed: it asks {asked}{' on one node' if len(bundles) == 1 else ''}; Ray says "
            f"{said}; live nodes: {each}. {_HOW_TO_FIT}")


def _no_node_has(bundle: Mapping[str, float], nodes: Sequence[Mapping[str, float]], local: bool) -> list[str]:
    """The resources of `bundle` no node of `nodes` has as much of: CPUs and GPUs, and (`local`: one node, which
    no other joins) custom resources too (elsewhere a node that has them may still join)."""
    return [k for k, v in bundle.items()
            if (k in ("CPU", "GPU") or local) and not any(r.get(k, 0.0) >= v for r in nodes)]


@dataclasses.dataclass
class _Host:
    """One process of a role: its actor, placement group and the driver-side copy of its log."""

    name: str  # 'inference0', 'learner' (rank 0), 'learner-rank1'
    actor: Any
    pg: Any
    bundle: dict[str, float]
    ref: Any  # ObjectRef of RoleHost.run: its exit code
    log_path: str
    offset: int = 0
    code: Optional[int] = None
    finished: bool = False
    unreachable: bool = False  # its actor stopped answering while Ray still had it alive: its node may be lost
    copied: bool = False  # its log is copied whole (as far as its node still had it) after it ended
    reaped: bool = False
    where: Optional[dict] = None
    copy_lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)


@dataclasses.dataclass
class _Role:
    name: str
    argv: list[str]
    log_path: str
    hosts: list[_Host]
    expected_exit: bool = False
    starting: Optional[threading.Thread] = None  # a restart being placed and started (off the caller's thread)
    start_failed: str = ""  # why the last restart could not be started (reported by `dead` as an exit)
    pending: str = ""  # why its restart waits to be placed (`describe_pending`), while it does


class RayLauncher:
    """`RoleLauncher` (arl.controller.supervision) over Ray actors. `ray_cfg` is the config's `ray` section;
    `learner_ranks` learner processes form the role 'learner' (rank 0 registers, the others follow it)."""

    runs_ranks = True  # the controller does not wrap the learner in torchrun: each rank is a process of its own
    elastic = True  # roles join mid-run (placed off the controller's thread, `add`) and leave (`remove`)

    def __init__(self, ray_cfg: Any, *, startup_timeout: float, learner_ranks: int = 1, servers_per_process: int = 1,
                 run_dir: str = "", log_poll_s: float = 0.5, processes: Optional[Mapping[str, int]] = None) -> None:
        """`processes`: how many processes of each role the run will spawn ({'inference': 1, 'rollout': 2}; the
        learner is one, with `learner_ranks` ranks): what is checked against the cluster before the first one is
        placed, and what a Ray started here (`address=local`) is sized for."""
        import ray

        self.cfg = ray_cfg
        self.startup_timeout = startup_timeout
        self.learner_ranks = max(1, int(learner_ranks))
        self.servers_per_process = servers_per_process
        self.run_dir = run_dir
        # every role's extra environment: the user's ray.env_vars, then the run's own (its shared secret) over them
        self.env: dict[str, str] = {str(k): str(v) for k, v in ray_cfg.env_vars.items()}
        self.roles: dict[str, _Role] = {}
        self._lock = threading.RLock()
        self._deadline: Optional[float] = None
        self.plan = planned_bundles(ray_cfg, processes, self.learner_ranks, servers_per_process)
        self._checked = False
        self._connected_here = not ray.is_initialized()
        if self._connected_here:
            address = str(ray_cfg.address)
            kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                  "configure_logging": False}
            if address == "local":
                kw["num_cpus"] = local_cpus(ray_cfg, self.plan)
                ray.init(**kw)
            else:
                ray.init(address=address, **kw)
        self._remote = ray.remote(RoleHost)
        self._stop = threading.Event()
        self._aborted = threading.Event()
        self._pump = threading.Thread(target=self._pump_logs, args=(log_poll_s,), name="arl-ray-logs", daemon=True)
        self._pump.start()

    # -- addresses -------------------------------------------------------------------------------------------
    @staticmethod
    def driver_address() -> str:
        """The driver node's address as Ray knows it: where the controller binds so that other nodes reach it."""
        import ray

        return ray.util.get_node_ip_address()

    # -- starting --------------------------------------------------------------------------------------------
    def abort(self) -> None:
        self._aborted.set()

    def spawn(self, name: str, argv: Sequence[str], log_path: str) -> None:
        role = self._new_role(name, argv, log_path)
        if not self._checked:
            self.check_fits()
            self._checked = True
        if self._deadline is None:
            self._deadline = time.monotonic() + self.startup_timeout
        with self._lock:
            self.roles[name] = role
        self._start(role, wait=True)

    def _new_role(self, name: str, argv: Sequence[str], log_path: str) -> _Role:
        if self._aborted.is_set():
            raise RolePlacementError(f"not starting {name}: the run was interrupted")
        if name in self.roles:
            raise ValueError(f"a role process named {name!r} already exists")
        if process_role(name) is None:  # its name says which bundle it gets
            raise ValueError(f"not a role process name: {name!r}")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        open(log_path, "ab").close()  # there from the start, like a local role's (copies append to it)
        return _Role(name, list(argv), log_path, [])

    def add(self, name: str, argv: Sequence[str], log_path: str) -> None:
        """Start a role mid-run (`arl.ctl scale`): placed and started off the caller's thread, as a restart is (a
        new actor and placement group wherever Ray puts them, or a node its autoscaler adds); one that is not
        placed shows as one that does not register within startup_timeout, and `pending` says why."""
        role = self._new_role(name, argv, log_path)
        with self._lock:
            self.roles[name] = role
        role.starting = threading.Thread(target=self._start_later, args=(role,), name=f"arl-ray-add-{name}",
                                         daemon=True)
        role.starting.start()

    def remove(self, name: str) -> None:
        """A role that left the run: its process stopped (an expected exit), then, off the caller's thread, its
        log copied, its actor ended and its placement group removed, so its node's resources are free again."""
        self.kill(name)
        role = self.roles.get(name)
        if role is not None:
            threading.Thread(target=self._reap, args=(role, True), name=f"arl-ray-remove-{name}",
                             daemon=True).start()

    def fits(self, role: str, index: int) -> str:
        """Why a new process of `role` `index` could never be placed on this cluster ('' : it could): CPUs or GPUs
        no node has, or (a Ray started here, one node) a custom resource the node lacks or cannot spare."""
        import ray

        bundle = bundle_for(self.cfg, role, index, self.servers_per_process)
        nodes, local = self._nodes()
        short = _no_node_has(bundle, nodes, local)
        if local and not short:  # one node, no autoscaler: what it has free now is all there will be
            free = {k: float(v) for k, v in ray.available_resources().items()}
            short = [k for k, v in bundle.items() if free.get(k, 0.0) + 1e-9 < v]
        if not short:
            return ""
        have = " | ".join(sorted(plain_resources(r) for r in nodes)) or "no live node"
        return (f"launcher=ray: a new {role} process needs {plain_resources(bundle)} on one node, and this Ray "
                f"cluster has no node with {' or '.join(f'{bundle[k]:g} {k}' for k in short)} "
                f"{'free ' if local else ''}(its nodes: {have}). {_HOW_TO_FIT}")

    def respawn(self, name: str) -> None:
        """Start `name` again (new actors and placement group; its log goes on in the same file). Does not block on
        placement: a restart that cannot be placed shows as one that does not register (startup_timeout). Custom
        resources that no live node has any more (its node was lost) are dropped: it restarts on a surviving
        node."""
        role = self.roles[name]
        if role.starting is not None and role.starting.is_alive():
            raise RuntimeError(f"{name} is already being restarted")
        role.expected_exit, role.start_failed, role.pending = False, "", ""
        # copying the rest of the old process's log, ending its actor and placing the new group make several
        # round trips to Ray (seconds when a node is gone): not on the caller's (the controller's event loop) thread
        role.starting = threading.Thread(target=self._restart, args=(role,), name=f"arl-ray-restart-{name}",
                                         daemon=True)
        role.starting.start()

    def _restart(self, role: _Role) -> None:
        try:
            # a node whose actor stopped answering may be gone while Ray still lists it (its health checks take tens
            # of seconds): the new process goes elsewhere at once, without waiting for Ray to decide
            avoid = {str(h.where["node_id"]) for h in role.hosts if h.unreachable and (h.where or {}).get("node_id")}
            self._reap(role, force=True)
        except Exception as e:  # noqa: BLE001 - the controller hears of it as an exit (`dead`) and applies its policy
            logger.exception("restarting %s failed", role.name)
            role.start_failed = f"{type(e).__name__}: {e}"
            return
        if not role.expected_exit:  # else killed (or the run ended) while the old one was reaped
            self._start_later(role, avoid)

    def _start_later(self, role: _Role, avoid: Collection[str] = ()) -> None:
        """Place and start `role` on this (a restart's or an addition's) thread, waiting for its placement."""
        try:
            self._start(role, wait=False, avoid=avoid)
            if role.expected_exit:
                self.kill(role.name)
                return
            self._await_placement(role)
            for r, h in enumerate(role.hosts):  # where it landed, for its role_placed record (or None if pending)
                h.where = self._node_of(h.pg, r) or h.where
        except Exception as e:  # noqa: BLE001 - the controller hears of it as an exit (`dead`) and applies its policy
            logger.exception("starting %s failed", role.name)
            role.start_failed = f"{type(e).__name__}: {e}"

    def _start(self, role: _Role, wait: bool, avoid: Collection[str] = ()) -> None:
        """Place and start `role`'s processes; `wait`: block until placed (the first start), else a restart: drop
        the custom resources no live node outside `avoid` (node ids) has, and keep off the nodes in `avoid`."""
        ranks = self.learner_ranks if role.name == "learner" else 1
        kind, index = process_role(role.name) or ("", 0)  # a process name: `spawn` checked it
        bundles = [bundle_for(self.cfg, kind, index + r, self.servers_per_process) for r in range(ranks)]
        if not wait:
            bundles = [self._placeable(b, role.name, avoid) for b in bundles]
        pg = self._placement_group(role.name, bundles, wait, avoid)
        files = self._files()
        hosts: list[_Host] = []
        for r, bundle in enumerate(bundles):
            hname = role.name if r == 0 else f"{role.name}-rank{r}"
            hosts.append(self._actor(hname, pg, r, bundle, role.log_path if r == 0 else
                                     os.path.join(os.path.dirname(role.log_path), f"{hname}.log")))
        env = dict(self.env)
        argv = [PYTHON if a == sys.executable else a for a in role.argv]
        if ranks > 1:  # the DeepSpeed rendezvous: rank 0's node, a port free there; world size = all ranks
            import ray

            where = ray.get([h.actor.where.remote() for h in hosts], timeout=self.startup_timeout)
            for h, w in zip(hosts, where):
                h.where = {**w, **(h.where or {})}
            port = ray.get(hosts[0].actor.free_port.remote(), timeout=self.startup_timeout)
            env.update(MASTER_ADDR=where[0]["node_ip"], MASTER_PORT=str(port), WORLD_SIZE=str(ranks))
        for r, h in enumerate(hosts):
            henv = dict(env)
            if ranks > 1:
                same_node = [o for o in hosts[:r] if (o.where or {}).get("node_id") == (h.where or {}).get("node_id")]
                henv.update(RANK=str(r), LOCAL_RANK=str(len(same_node)))
            h.ref = h.actor.run.remote(argv, henv, files)
            if h.where is not None:
                logger.info("started %s on node %s (%s), bundle %s, log %s", h.name, h.where.get("node_ip"),
                            h.where.get("node_id", "")[:12], h.bundle, h.log_path)
        role.hosts = hosts

    def _await_placement(self, role: _Role) -> None:
        """Wait (the restart's thread) until `role`'s placement group is placed, it is killed, or startup_timeout
        passed. Not placed after PENDING_NOTICE_S: say why on the console and keep it in `role.pending` (refreshed
        while it waits), where the controller reads it when the restart does not register in time."""
        import ray

        ready_ref, deadline = role.hosts[0].pg.ready(), time.monotonic() + self.startup_timeout
        ready, _ = ray.wait([ready_ref], timeout=min(PENDING_NOTICE_S, self.startup_timeout))
        said: Optional[str] = None  # Ray's scheduling state last said on the console
        seen = 0.0
        while not ready and not role.expected_exit and not self._stop.is_set() and time.monotonic() < deadline:
            if time.monotonic() - seen > 5.0:
                state, role.pending, seen = *self._why_pending(role), time.monotonic()
                if state != said:  # first, or Ray's reason changed
                    logger.warning("%s", role.pending)
                    said = state
            ready, _ = ray.wait([ready_ref], timeout=1.0)
        if ready and said is not None:
            logger.warning("%s is placed now", role.name)
        if ready:
            role.pending = ""

    def _why_pending(self, role: _Role) -> tuple[str, str]:
        """(Ray's scheduling state, `describe_pending`) of `role`'s placement group, from what Ray says now."""
        import ray

        try:
            stats = ray.util.placement_group_table(role.hosts[0].pg)
            state = str((stats.get("stats") or {}).get("scheduling_state") or stats.get("state") or "")
        except Exception:  # noqa: BLE001 - said as unknown
            state = ""
        try:  # Ray has no public per-node view of free resources (2.60); without it only the totals are said
            from ray._private.state import available_resources_per_node

            free: Optional[dict] = available_resources_per_node()
        except Exception:  # noqa: BLE001
            free = None
        nodes = [(f"{n.get('NodeManagerAddress')} ({str(n.get('NodeID'))[:12]}):", n.get("Resources", {}),
                  None if free is None else free.get(n.get("NodeID"), {})) for n in ray.nodes() if n.get("Alive")]
        return state, describe_pending(role.name, [h.bundle for h in role.hosts], state, nodes)

    def pending(self, name: str) -> str:
        role = self.roles.get(name)
        return role.pending if role is not None and not role.expected_exit else ""

    def _files(self) -> dict[str, bytes]:
        path = os.path.join(self.run_dir, "config.yaml") if self.run_dir else ""
        if not path or not os.path.exists(path):
            return {}
        with open(path, "rb") as f:
            return {path: f.read()}

    def check_fits(self) -> None:
        """Refuse at once, in plain words, a run that this cluster can never hold: a process whose CPUs or GPUs no
        node has, the run's CPUs or GPUs beyond the cluster's total, and (with `address=local`, one node that no
        other joins) a custom resource the node lacks. A custom resource no node has yet is only warned about
        elsewhere: a node may still join (the wait is `startup_timeout`)."""
        import ray

        if not self.plan:
            return
        nodes, local = self._nodes()
        total = {k: float(v) for k, v in ray.cluster_resources().items()}
        have = " | ".join(sorted(plain_resources(r) for r in nodes)) or "no live node"
        for name, bundle in self.plan:
            short = _no_node_has(bundle, nodes, local)
            if short:
                raise RolePlacementError(
                    f"launcher=ray: role {name} needs {plain_resources(bundle)} on one node, and no node of this Ray "
                    f"cluster has {' or '.join(f'{bundle[k]:g} {k}' for k in short)} (its nodes: {have}). "
                    f"{_HOW_TO_FIT}")
        for key in ("CPU", "GPU"):
            need = sum(b.get(key, 0.0) for _, b in self.plan)
            if need > total.get(key, 0.0) + 1e-9:
                each = ", ".join(f"{n} {b[key]:g}" for n, b in self.plan if b.get(key))
                raise RolePlacementError(
                    f"launcher=ray: the run's {len(self.plan)} role processes need {need:g} {key} in all ({each}), "
                    f"and this Ray cluster has {total.get(key, 0.0):g} {key} (its nodes: {have}). {_HOW_TO_FIT}")

    def _nodes(self) -> tuple[list[dict], bool]:
        """(the live nodes' resources, whether this is a Ray the run started: one node that no other joins)."""
        import ray

        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        return nodes, self._connected_here and str(self.cfg.address) == "local"

    def _placement_group(self, name: str, bundles: list[dict[str, float]], wait: bool,
                         avoid: Collection[str] = ()) -> Any:
        """A placement group for `bundles`, on no node in `avoid` (node ids)."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        strategy = str(self.cfg.strategy) if len(bundles) > 1 else "PACK"
        kw: dict[str, Any] = {}
        # bundle label selectors: Ray 2.47 has them, placement honours them since 2.50 (ray-project/ray#55599)
        if avoid and "bundle_label_selector" in inspect.signature(placement_group).parameters:
            off = f"!{next(iter(avoid))}" if len(avoid) == 1 else f"!in({', '.join(sorted(avoid))})"
            kw["bundle_label_selector"] = [{_NODE_ID_LABEL: off} for _ in bundles]
            logger.warning("%s: placing it on no node of %s (they did not answer)", name,
                           sorted(n[:12] for n in avoid))
        elif avoid:  # an older Ray: only the lost node's own resources are dropped (see `_placeable`)
            logger.warning("%s: this Ray cannot keep a placement group off a node (no bundle_label_selector); it may "
                           "wait until Ray marks node(s) %s dead", name, sorted(n[:12] for n in avoid))
        pg = placement_group(bundles, strategy=strategy, name=f"arl-{name}-{os.getpid()}-{time.monotonic_ns()}", **kw)
        if wait:  # in slices: `abort` (Ctrl-C) ends the wait within one
            deadline, ready_ref = self._deadline or 0.0, pg.ready()
            while True:  # at least one look, even past the deadline (a group placed at once is placed)
                ready, _ = ray.wait([ready_ref], timeout=min(0.25, max(0.1, deadline - time.monotonic())))
                if ready or self._aborted.is_set() or time.monotonic() >= deadline:
                    break
            if not ready:
                remove_placement_group(pg)
                if self._aborted.is_set():
                    raise RolePlacementError(f"role {name}: interrupted while waiting to be placed")
                raise RolePlacementError(
                    f"role {name} could not be placed within startup_timeout={self.startup_timeout:g}s: it needs "
                    f"{' and '.join(plain_resources(b) for b in bundles)}"
                    f"{f' (strategy {strategy})' if len(bundles) > 1 else ''}; the cluster has "
                    f"{plain_resources(ray.cluster_resources())}, of which {plain_resources(ray.available_resources())}"
                    f" are free. Check ray.placement and ray.*_per_* or add nodes.")
        return pg

    def _placeable(self, bundle: dict[str, float], name: str,
                   avoid: Collection[str] = ()) -> dict[str, float]:
        """`bundle` without the custom resources that no live node outside `avoid` has (a restart after its node
        was lost)."""
        import ray

        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive") and n.get("NodeID") not in avoid]
        gone = [k for k in bundle if k not in _NOT_CUSTOM and not any(r.get(k, 0.0) >= bundle[k] for r in nodes)]
        if gone:
            logger.warning("%s: no live node has %s any more; restarting it without that placement", name, gone)
        return {k: v for k, v in bundle.items() if k not in gone}

    def _actor(self, name: str, pg: Any, index: int, bundle: dict[str, float], log_path: str) -> _Host:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        custom = {k: v for k, v in bundle.items() if k not in _NOT_CUSTOM}
        actor = self._remote.options(
            num_cpus=bundle.get("CPU", 0.0), num_gpus=bundle.get("GPU", 0.0), resources=custom or None,
            max_concurrency=8, max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
        ).remote(name)
        host = _Host(name, actor, pg, bundle, None, log_path)
        host.where = self._node_of(pg, index)
        return host

    @staticmethod
    def _node_of(pg: Any, index: int) -> Optional[dict]:
        """Node of bundle `index` of `pg` (None until it is placed): its id, address and custom resources."""
        import ray

        try:
            node_id = ray.util.placement_group_table(pg).get("bundles_to_node_id", {}).get(index)
        except Exception:  # noqa: BLE001
            return None
        if not node_id:
            return None
        for node in ray.nodes():
            if node.get("NodeID") == node_id:
                custom = sorted(k for k in node.get("Resources", {})
                                if k not in _NOT_CUSTOM and not k.startswith(("node:", "accelerator_type:")))
                return {"node_id": node_id, "node_ip": node.get("NodeManagerAddress"), "node_resources": custom}
        return {"node_id": node_id}

    # -- watching --------------------------------------------------------------------------------------------
    def where(self, name: str) -> dict[str, Any]:
        """Where process `name` runs (for the metrics): node id, address and custom resources of each rank."""
        role = self.roles.get(name)
        if role is None:
            return {}
        for r, h in enumerate(role.hosts):
            if h.where is None or "node_ip" not in h.where:
                h.where = self._node_of(h.pg, r) or h.where
        first = dict(role.hosts[0].where or {}) if role.hosts else {}
        if len(role.hosts) > 1:
            first["ranks"] = [dict(h.where or {}) for h in role.hosts]
        return first

    def _finished(self, h: _Host) -> bool:
        import ray
        from ray.exceptions import ActorUnavailableError, RayError

        if h.finished:
            return True
        if h.ref is None:
            return False
        ready, _ = ray.wait([h.ref], timeout=0)
        if not ready:
            return False
        try:
            h.code = int(ray.get(h.ref))
        except RayError as e:  # its actor died: the node was lost, or the actor was killed
            logger.warning("%s: its Ray actor is gone (%s)", h.name, type(e).__name__)
            h.code = None
            h.unreachable = isinstance(e, ActorUnavailableError)
        h.finished = True
        return True

    def dead(self) -> list[tuple[str, Optional[int]]]:
        """Roles that ended unasked, once the rest of their log is in the run directory (the controller shows its
        last lines): the copy is the log thread's, so this never waits on Ray (it runs on the event loop)."""
        out: list[tuple[str, Optional[int]]] = []
        with self._lock:
            roles = list(self.roles.values())
        for role in roles:
            if role.expected_exit or (role.starting is not None and role.starting.is_alive()):
                continue
            if role.start_failed:
                out.append((role.name, None))
                continue
            for h in role.hosts:
                if not h.reaped and self._finished(h) and h.copied:
                    out.append((role.name, h.code))
                    break
        return out

    def has(self, name: str) -> bool:
        return name in self.roles

    def alive(self, name: str) -> bool:
        role = self.roles.get(name)
        if role is None:
            return False
        if role.starting is not None and role.starting.is_alive():
            return True
        return any(not self._finished(h) for h in role.hosts)

    def log_path(self, name: str) -> str:
        role = self.roles.get(name)
        return role.log_path if role is not None else ""

    def stack_dump(self, name: str, wait: float) -> tuple[str, str]:
        import ray

        role = self.roles.get(name)
        if role is None or not self.alive(name):
            return "?", ""
        try:
            state, dump = ray.get(role.hosts[0].actor.stack_dump.remote(wait), timeout=wait + 10.0)
        except Exception as e:  # noqa: BLE001
            return f"unreachable ({type(e).__name__})", ""
        self._copy_log(role.hosts[0])
        return state, dump

    # -- stopping --------------------------------------------------------------------------------------------
    def kill(self, name: str) -> None:
        role = self.roles.get(name)
        if role is None:
            return
        role.expected_exit = True
        for h in role.hosts:
            if not h.finished:
                h.actor.kill.remote()

    def expect_exit(self) -> None:
        for role in list(self.roles.values()):
            role.expected_exit = True

    def _hosts(self) -> list[_Host]:
        with self._lock:
            return [h for role in self.roles.values() for h in role.hosts]

    def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while any(not self._finished(h) for h in self._hosts()) and time.monotonic() < deadline:
            time.sleep(0.05)
        return all(self._finished(h) for h in self._hosts())

    def terminate_all(self, grace: float = 3.0) -> None:
        """Every host ends its role process as `LocalLauncher.terminate_all` does (SIGTERM, SIGKILL after `grace`
        seconds), all at once; then every actor is ended."""
        self.expect_exit()
        for h in self._hosts():
            if not self._finished(h):
                h.actor.terminate.remote(grace)
        if not self.wait_all(grace + 3.0):
            logger.warning("role processes still running %.0fs after SIGTERM: %s", grace + 3.0,
                           [h.name for h in self._hosts() if not self._finished(h)])
        for role in list(self.roles.values()):
            self._reap(role, force=True)

    def close(self) -> None:
        """The run is over: stop every role process and actor, release the placement groups, disconnect from Ray
        (stopping it if this launcher started it)."""
        import ray

        self.expect_exit()
        for role in list(self.roles.values()):  # a restart in flight ends first (it kills what it started)
            if role.starting is not None:
                role.starting.join(timeout=self.startup_timeout)
        if any(not self._finished(h) for h in self._hosts()):
            self.terminate_all(1.0)
        for role in list(self.roles.values()):
            self._reap(role, force=True)
        self._stop.set()
        self._pump.join(timeout=5.0)
        if self._connected_here and ray.is_initialized():
            ray.shutdown()

    def _reap(self, role: _Role, force: bool) -> None:
        """Copy the rest of each process's log, then end its actor and release its placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        pgs = []
        for h in role.hosts:
            if h.reaped:
                continue
            if not force and not self._finished(h):
                continue
            self._copy_log(h, final=True)
            try:
                ray.get(h.actor.discard_log.remote(), timeout=2.0)
            except Exception:  # noqa: BLE001 - gone with its node, or busy: nothing more to do
                pass
            try:
                ray.kill(h.actor, no_restart=True)  # its role process dies with it (PR_SET_PDEATHSIG)
            except Exception:  # noqa: BLE001
                pass
            h.reaped = True
            pgs.append(h.pg)
        for pg in {id(p): p for p in pgs}.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass

    # -- logs ------------------------------------------------------------------------------------------------
    def _copy_log(self, h: _Host, final: bool = False) -> None:
        """Append what the role wrote on its node since the last copy to its log in the run directory. `final`
        (the role ended): all of it, except that a copy more than FINAL_LOG_MAX behind skips to the newest
        FINAL_LOG_MAX (a crash's last lines matter most) and says how much it skipped."""
        import ray

        with h.copy_lock:
            if h.reaped or h.copied:
                return
            rounds = _COPY_ROUNDS
            try:
                if final:
                    behind = int(ray.get(h.actor.log_size.remote(), timeout=5.0)) - h.offset
                    rounds = -(-min(behind, FINAL_LOG_MAX) // _LOG_CHUNK) + 1
                    if behind > FINAL_LOG_MAX:
                        skip = behind - FINAL_LOG_MAX
                        with open(h.log_path, "ab") as f:
                            f.write(f"\n[arl: {skip} bytes of this log were not copied from its node; its last "
                                    f"{FINAL_LOG_MAX} bytes follow]\n".encode())
                        h.offset += skip
                for _ in range(rounds):
                    data = ray.get(h.actor.read_log.remote(h.offset), timeout=5.0)
                    if not data:
                        break
                    with open(h.log_path, "ab") as f:
                        f.write(data)
                    h.offset += len(data)
            except Exception:  # noqa: BLE001 - its actor is gone (node lost): what we copied is what there is
                pass
            if final:
                h.copied = True

    def _pump_logs(self, every: float) -> None:
        """Copy what every role adds to its log; once a role ended, the rest of it (then `dead` reports it)."""
        while not self._stop.wait(every):
            for h in self._hosts():
                if not h.reaped and h.ref is not None:
                    self._copy_log(h, final=self._finished(h))
