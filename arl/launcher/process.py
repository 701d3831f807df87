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
from typing import Optional, Sequence

from arl.utils.proc import die_with_parent_preexec, tail
from arl.utils.proc import signal_group as _signal_group

__all__ = ["Child", "ProcessGroup", "tail", "_signal_group"]  # tail/_signal_group: the controller's imports

logger = logging.getLogger("arl.launcher")


@dataclasses.dataclass
class Child:
    name: str
    proc: subprocess.Popen
    log_path: str
    expected_exit: bool = False


class ProcessGroup:
    """The set of role processes of one run."""

    def __init__(self) -> None:
        self.children: dict[str, Child] = {}
        self.env: dict[str, str] = {}  # extra environment of every child (e.g. the run's shared secret)

    def spawn(self, name: str, argv: Sequence[str], log_path: str, env: Optional[dict[str, str]] = None) -> Child:
        if name in self.children:
            raise ValueError(f"a child named {name!r} already exists")
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        log = open(log_path, "ab", buffering=0)
        full_env = dict(os.environ)
        full_env.update(self.env)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=full_env,
            start_new_session=True,
            preexec_fn=die_with_parent_preexec(),
        )
        log.close()
        child = Child(name, proc, log_path)
        self.children[name] = child
        logger.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        return child

    def respawn(self, name: str) -> Child:
        """Start `name` again with its argv and log (appended to): a restart after it died or was killed."""
        old = self.children[name]
        if old.proc.poll() is None:
            raise RuntimeError(f"{name} (pid {old.proc.pid}) is still running")
        del self.children[name]
        return self.spawn(name, list(old.proc.args), old.log_path)

    def dead(self) -> list[Child]:
        """Children that exited without being asked to."""
        return [c for c in self.children.values() if not c.expected_exit and c.proc.poll() is not None]

    def alive(self) -> list[Child]:
        return [c for c in self.children.values() if c.proc.poll() is None]

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children.values()]

    def expect_exit(self) -> None:
        for c in self.children.values():
            c.expected_exit = True

    def wait_all(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                return True
            time.sleep(0.05)
        return not self.alive()

    def terminate(self, grace: float = 3.0) -> None:
        """SIGTERM every child's process group, then SIGKILL what is left after `grace` seconds."""
        self.expect_exit()
        for c in self.alive():
            _signal_group(c.proc.pid, signal.SIGTERM)
        if not self.wait_all(grace):
            for c in self.alive():
                logger.warning("%s (pid %d) ignored SIGTERM; killing", c.name, c.proc.pid)
                _signal_group(c.proc.pid, signal.SIGKILL)
            self.wait_all(2.0)
        for c in self.children.values():
            try:
                c.proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
