"""Real `ray start` nodes on this one host, started the way README's cluster section says: the head with
RAY_AUTH_MODE=token and a token made by `ray get-auth-token --generate`, every other node with the same mode and
the head's token (RAY_AUTH_TOKEN). Each node has a HOME of its own (a machine of its own as far as Ray's token file
goes), the cluster a private --temp-dir, and every port is picked free: nothing is shared with another Ray on this
host. `kill_node` and `shutdown` end only the process groups these nodes were started in (`ray start --block`
in a session of its own), never a broad `ray stop`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

from arl.utils.net import free_port
from tests.waiting import wait_until

RAY = os.path.join(os.path.dirname(sys.executable), "ray")


class RayNodes:
    def __init__(self, root: str, num_cpus: int = 2) -> None:
        self.root = root
        self.num_cpus = num_cpus
        self.temp_dir = tempfile.mkdtemp(prefix="arl-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: dict[str, subprocess.Popen] = {}
        self.retry: dict[str, tuple[list[str], dict[str, str]]] = {}  # how each worker node was started
        self.restarts: dict[str, int] = {}
        self.token = ""

    def home(self, name: str) -> str:
        path = os.path.join(self.root, f"home-{name}")
        os.makedirs(path, exist_ok=True)
        return path

    def env(self, name: str, token: Optional[str] = None) -> dict[str, str]:
        """The environment of a `ray` command on node `name` (its own HOME), with the cluster's auth settings as
        README says: RAY_AUTH_MODE=token and, off the head, the head's token as RAY_AUTH_TOKEN."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(HOME=self.home(name), RAY_AUTH_MODE="token", RAY_USAGE_STATS_ENABLED="0",
                   # a host shared with other work (2 cores, often overloaded): no idle workers started ahead, and
                   # a slow worker start is not taken for a failed one
                   RAY_enable_worker_prestart="0", RAY_prestart_worker_first_driver="0",
                   RAY_worker_register_timeout_seconds="300",
                   RAY_worker_niceness="0",  # Ray's default 15 leaves the roles (its workers' children) starved
                   # the roles inherit the node's HOME: keep caches (DeepSpeed's compiled ops) where they are
                   XDG_CACHE_HOME=os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"))
        token = self.token if token is None else token
        if token:
            env["RAY_AUTH_TOKEN"] = token
        return env

    def _ports(self) -> list[str]:
        return [f"--node-manager-port={free_port()}", f"--object-manager-port={free_port()}",
                f"--metrics-export-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
                f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
                f"--temp-dir={self.temp_dir}", "--node-ip-address=127.0.0.1", f"--num-cpus={self.num_cpus}",
                "--disable-usage-stats", "--block"]

    def start_head(self, resources: str = '{"node_a": 1}') -> None:
        env = self.env("head", token="")
        # README: `ray get-auth-token --generate` on the head (the token lands in its ~/.ray/auth_token)
        out = subprocess.run([RAY, "get-auth-token", "--generate"], env=env, capture_output=True, text=True,
                             timeout=120, check=True)
        self.token = out.stdout.strip()
        assert self.token, out.stderr
        for attempt in range(3):  # Ray gives a node's raylet 30 s to register: too short on an overloaded host
            self._start("head", [RAY, "start", "--head", f"--port={self.port}", f"--resources={resources}",
                                 "--include-dashboard=false", f"--dashboard-port={free_port()}",
                                 f"--ray-client-server-port={free_port()}", *self._ports()], env)
            wait_until(lambda: self.procs["head"].poll() is not None or self.alive_nodes() >= 1, 300,
                       "the Ray head to answer `ray status`", interval=1)
            if self.procs["head"].poll() is None:
                return
            self._kill("head")
        raise AssertionError(f"the Ray head did not start 3 times; its output:\n{self.output('head')[-3000:]}")

    def add_node(self, name: str, resources: str, token: Optional[str] = None) -> subprocess.Popen:
        """`ray start --address=HEAD` on node `name`; it is up once `ray status` counts it (`wait_nodes`, which
        starts it again if it timed out starting)."""
        argv = [RAY, "start", f"--address={self.address}", f"--resources={resources}", *self._ports()]
        self.retry[name] = (argv, self.env(name, token))
        return self._start(name, *self.retry[name])

    def _start(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(os.path.join(self.root, f"{name}.out"), "ab")
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, cwd=self.root)
        log.close()
        self.procs[name] = proc
        return proc

    def output(self, name: str) -> str:
        with open(os.path.join(self.root, f"{name}.out"), errors="replace") as f:
            return f.read()

    def status(self, name: str = "driver") -> subprocess.CompletedProcess:
        return subprocess.run([RAY, "status", f"--address={self.address}"], env=self.env(name), capture_output=True,
                              text=True, timeout=120)

    def alive_nodes(self) -> int:
        out = self.status()
        if out.returncode != 0:
            return 0
        lines, count, inside = out.stdout.splitlines(), 0, False
        for line in lines:
            if line.strip() in ("Active:", "Idle:"):
                inside = True
            elif line and not line.startswith(" "):
                inside = False
            elif inside and line.split() and line.split()[0].isdigit():
                count += int(line.split()[0])
        return count

    def wait_nodes(self, n: int, timeout: float = 420) -> None:
        def up() -> bool:
            for name, (argv, env) in self.retry.items():
                if self.procs[name].poll() is not None and self.restarts.get(name, 0) < 2:
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    self._kill(name)
                    self._start(name, argv, env)
            return self.alive_nodes() >= n

        wait_until(up, timeout, f"{n} Ray nodes to be up", interval=1)

    def kill_node(self, name: str) -> None:
        """The node's machine goes away: SIGKILL to every process of its `ray start` (raylet, its workers)."""
        self.retry.pop(name, None)
        self._kill(name)

    def _kill(self, name: str) -> None:
        proc = self.procs[name]
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

    def shutdown(self) -> None:
        """SIGTERM, then SIGKILL, to the process groups of the nodes started here (workers first, the head last)."""
        names = [n for n in self.procs if n != "head"] + (["head"] if "head" in self.procs else [])
        for name in names:
            try:
                os.killpg(self.procs[name].pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5  # then SIGKILL: a head left with a dead node took the whole 20 s it had
        for name in names:
            try:
                self.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.procs[name].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)
