"""The `RoleLauncher` protocol is whole (the controller asks every launcher the same, sniffing nothing), process
names are parsed in one place, and Ray's `RoleHost` runs its role process with the local launcher's code (no Ray
cluster needed: the host is a plain class until Ray makes it an actor)."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest

from arl.controller.supervision import RoleLauncher, Supervisor, process_role
from arl.launch.local import LocalLauncher
from tests.controller.fakes import FakeLauncher
from tests.waiting import wait_until


def protocol_members() -> set[str]:
    return {n for n in vars(RoleLauncher) if not n.startswith("_")} | set(RoleLauncher.__annotations__)


def test_the_protocol_names_what_the_controller_and_the_run_ask_of_a_launcher() -> None:
    assert {"runs_ranks", "env", "where", "close", "abort", "spawn", "respawn", "kill", "dead", "stack_dump",
            "terminate_all"} <= protocol_members()


@pytest.mark.parametrize("make", [LocalLauncher, FakeLauncher], ids=["local", "fake"])
def test_every_launcher_implements_the_whole_protocol(make) -> None:
    launcher = make()
    missing = [m for m in sorted(protocol_members()) if not hasattr(launcher, m)]
    assert missing == [], f"{make.__name__} lacks {missing}"
    assert launcher.where("rollout0") == {} and isinstance(launcher.env, dict)
    assert launcher.runs_ranks is False  # the controller starts a multi-rank learner under torchrun
    launcher.close()


def test_the_ray_launcher_implements_the_whole_protocol() -> None:
    from arl.launch.ray import RayLauncher  # imports no Ray until one is made

    import inspect
    import re

    init = inspect.getsource(RayLauncher.__init__)  # attributes it sets on each instance
    missing = [m for m in sorted(protocol_members())
               if not hasattr(RayLauncher, m) and not re.search(rf"self\.{m}\b\s*(:[^=]*)?=", init)]
    assert missing == [], f"RayLauncher lacks {missing}"
    assert RayLauncher.runs_ranks is True  # each learner rank is a process it places


def test_process_names_are_parsed_in_one_place() -> None:
    assert [process_role(n) for n in ("inference3", "learner", "rollout12")] == [("inference", 3), ("learner", 0),
                                                                                  ("rollout", 12)]
    assert process_role("learner2") == ("learner", 2)  # a trainable listed policy's learner
    assert [process_role(n) for n in ("inferencex", "learner-rank1", "rollout", "learner0", "evaluator1")] == \
        [None] * 5
    s = Supervisor(num_inference=4, num_rollout=2, servers_per_process=2, startup_timeout=1.0)
    for role, index in [("inference", 3), ("rollout", 1), ("learner", 0)]:
        name = s.process_of(role, index)
        assert process_role(name) == (role, index if role != "inference" else index // 2)


SLEEPER = [sys.executable, "-c", "import faulthandler, os, signal, sys, time; "
                                 "faulthandler.register(signal.SIGUSR1, all_threads=True); "
                                 "print('up', os.environ.get('ARL_BIND_HOST'), os.environ.get('ARL_SECRET'), "
                                 "flush=True); time.sleep(600)"]
STUBBORN = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                                  "print('up', flush=True); time.sleep(600)"]


class HostRun:
    """`RoleHost.run` in a thread, as Ray runs it in its threaded actor."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        pytest.importorskip("ray")
        from arl.launch.ray import PYTHON, RoleHost

        self.host = RoleHost(name)
        self.code: list[int] = []
        argv = [PYTHON if a == sys.executable else a for a in argv]
        self.thread = threading.Thread(target=lambda: self.code.append(self.host.run(argv, env, {})), daemon=True)
        self.thread.start()

    def log(self) -> str:
        return self.host.read_log(0).decode(errors="replace")


def test_a_ray_host_runs_its_role_with_the_local_launchers_code() -> None:
    run = HostRun("rollout0", SLEEPER, {"ARL_SECRET": "s3cret"})
    try:
        assert isinstance(run.host.procs, LocalLauncher)
        wait_until(lambda: "up" in run.log(), 60, "the role process to start")
        assert "s3cret" in run.log() and run.host.pid() > 0
        state, dump = run.host.stack_dump(5.0)  # the local launcher's post-mortem
        assert state != "?" and "most recent call first" in dump, (state, dump)
        run.host.kill()
        run.thread.join(30)
        assert run.code == [-signal.SIGKILL]
        assert run.host.stack_dump(0.1) == ("?", "")
        run.host.discard_log()  # ended: the node-local copy goes
        assert not os.path.exists(run.host.log_path)
    finally:
        run.host.terminate(0.5)
        run.host.discard_log()


def test_a_ray_host_terminates_as_the_local_launcher_does() -> None:
    run = HostRun("inference0", STUBBORN, {})
    try:
        wait_until(lambda: "up" in run.log(), 60, "the role process to start")
        run.host.terminate(0.5)  # SIGTERM ignored: SIGKILL after the grace
        run.thread.join(30)
        assert run.code == [-signal.SIGKILL]
    finally:
        run.host.procs.terminate_all(0.1)
        run.host.discard_log()


def test_a_kill_that_overtakes_the_start_still_kills() -> None:
    """Ray runs the host's methods in threads: a kill sent right after the start may run before `run` has started
    the process; it waits for the start instead of finding nothing to kill."""
    pytest.importorskip("ray")
    from arl.launch.ray import RoleHost

    host = RoleHost("rollout0")
    killer = threading.Thread(target=host.kill, daemon=True)
    killer.start()
    code: list[int] = []
    runner = threading.Thread(target=lambda: code.append(host.run(SLEEPER, {}, {})), daemon=True)
    runner.start()
    try:
        runner.join(60)
        assert code == [-signal.SIGKILL]
    finally:
        host.procs.terminate_all(0.1)
        host.discard_log()
