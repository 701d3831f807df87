"""Child-process supervision: start roles as OS processes, notice deaths, leave no orphans.

Children run in their own session (so a terminal Ctrl-C reaches only the controller, which then shuts them down
in order) and get SIGKILL from the kernel if the controller dies first (PR_SET_PDEATHSIG), so even a kill -9 of
the controller leaves nothing behind.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import time
from typing import Any, Optional, Sequence

from arl.utils.forensics import request_stack_dump
from arl.utils.proc import die_with_parent_preexec, signal_group

logger = logging.getLogger("arl.launch")


@dataclasses.dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: str
    expected_exit: bool = False


class LocalLauncher:
    """`RoleLauncher` (arl.controller.supervision) over the local OS processes of one run. Ray's `RoleHost`
    (arl.launch.ray) runs its one role process on its node with one of these too."""

    runs_ranks = False  # a learner on several ranks is one process: torchrun, which starts the ranks
    elastic = True  # starts a role mid-run at once (`arl.ctl scale`)

    def __init__(self) -> None:
        self.children: dict[str, Child] = {}
        self.env: dict[str, str] = {}  # extra environment of every child (e.g. the run's shared secret)
        self.aborted = False

    def abort(self) -> None:
        self.aborted = True

    def spawn(self, name: str, argv: Sequence[str], log_path: str) -> None:
        if self.aborted:
            raise RuntimeError(f"not starting {name}: the run was interrupted")
        if name in self.children:
            raise ValueError(f"a child named {name!r} already exists")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        with open(log_path, "ab", buffering=0) as log:
            proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={"PYTHONUNBUFFERED": "1", **os.environ, **self.env},
                                    start_new_session=True, preexec_fn=die_with_parent_preexec())
        self.children[name] = Child(name, proc, log_path)
        logger.info("started %s (pid %d), log %s", name, proc.pid, log_path)

    def respawn(self, name: str) -> None:
        """Start `name` again with its argv and log (appended to); it must have exited (the controller kills a hung
        one first and waits without blocking its event loop)."""
        old = self.children[name]
        if old.proc.poll() is None:
            raise RuntimeError(f"{name} (pid {old.proc.pid}) is still running")
        del self.children[name]
        self.spawn(name, list(old.proc.args), old.log_path)

    add = spawn  # a process starts at once: nothing to wait for

    def remove(self, name: str) -> None:
        """A role that left the run: stopped (nothing else to give back on one host)."""
        self.kill(name)

    def fits(self, role: str, index: int) -> str:
        return ""  # one host: a role that starts here fits as the others did

    def kill(self, name: str) -> None:
        """Kill `name` now if it runs; its exit is expected (not reported by `dead`)."""
        child = self.children.get(name)
        if child is not None:
            child.expected_exit = True
            if child.proc.poll() is None:
                signal_group(child.proc.pid, signal.SIGKILL)

    def dead(self) -> list[tuple[str, Optional[int]]]:
        """(name, exit code) of children that exited without being asked to."""
        return [(c.name, c.proc.returncode) for c in self.children.values()
                if not c.expected_exit and c.proc.poll() is not None]

    def has(self, name: str) -> bool:
        return name in self.children

    def alive(self, name: str) -> bool:
        child = self.children.get(name)
        return child is not None and child.proc.poll() is None

    def log_path(self, name: str) -> str:
        child = self.children.get(name)
        return child.log_path if child is not None else ""

    def where(self, name: str) -> dict[str, Any]:
        return {}  # every role runs on this host: nothing to record

    def pending(self, name: str) -> str:
        return ""  # a local process starts at once

    def close(self) -> None:
        """Nothing is held beyond the processes (`terminate_all` ended them; PR_SET_PDEATHSIG backs it up)."""

    def stack_dump(self, name: str, wait: float) -> tuple[str, str]:
        if not self.alive(name):
            return "?", ""
        child = self.children[name]
        return request_stack_dump(child.proc.pid, child.log_path, wait)

    def expect_exit(self) -> None:
        for c in self.children.values():
            c.expected_exit = True

    def _running(self) -> list[Child]:
        return [c for c in self.children.values() if c.proc.poll() is None]

    def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._running()

    def terminate_all(self, grace: float = 3.0) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left after `grace` seconds."""
        self.expect_exit()
        for c in self._running():
            signal_group(c.proc.pid, signal.SIGTERM)
        if not self.wait_all(grace):
            for c in self._running():
                logger.warning("%s (pid %d) ignored SIGTERM; killing", c.name, c.proc.pid)
                signal_group(c.proc.pid, signal.SIGKILL)
            self.wait_all(2.0)
        for c in self.children.values():
            try:
                c.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
