"""Shared pieces of the fault tests: start a real run in the background, find its processes, read its records.

Every fault test appends one JSON line to `$ARL_FAULT_RESULTS` (when set) saying what it injected and what the
run's final accounting was; scripts/fault_report.py prints the table.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

from arl.report.traces import read_jsonl
from tests.waiting import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = os.path.join(ROOT, "training", "main_async_ppo.py")

TINY = [
    "learner.batch_size=2",
    "agent.group_size=4",
    "rollout.max_concurrent_rollouts=8",
    "eval.max_prompts=8",
    "eval.every_n_steps=0",
    "progress=false",
    "startup_timeout=240",
]


HOLD_MODULE = '''
"""The math single-step agent, except that a group with tokens of policy version >= ARL_TEST_HOLD_FROM waits for
the file ARL_TEST_RELEASE before it is returned: the run cannot train past that version until the test says so.
Several versions ("2,4"): past the k-th (k >= 1) it waits for ARL_TEST_RELEASE + str(k) too. ARL_TEST_HOLD_PROCESS
("rollout1=2"): every group of that rollout process waits for release k instead, whatever its versions, and the
file ARL_TEST_RELEASE + ".held.rollout1" says one does."""
import asyncio
import os
import sys

from arl.agents.math_single_step import MathSingleStepAgent
from arl.api import register_agent

RELEASE = os.environ["ARL_TEST_RELEASE"]
HOLD_FROM = [int(v) for v in os.environ["ARL_TEST_HOLD_FROM"].split(",")]
_ARGS = dict(zip(sys.argv[1::2], sys.argv[2::2]))  # the role process's --role R --index I
PROCESS = _ARGS.get("--role", "") + _ARGS.get("--index", "")
HOLD_PROCESS = dict(kv.split("=") for kv in os.environ.get("ARL_TEST_HOLD_PROCESS", "").split(",") if kv)


class HoldAgent(MathSingleStepAgent):
    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        trajs = await super().collect_trajectory(prompt, env, obs_queue, act_queue)
        newest = max((int(t.versions.max()) for t in trajs if len(t.versions)), default=-1)
        if PROCESS in HOLD_PROCESS:  # instead of the version holds: held whatever its versions, and marked so
            open(RELEASE + ".held." + PROCESS, "w").close()
            k = int(HOLD_PROCESS[PROCESS])
            while not os.path.exists(RELEASE + (str(k) if k else "")):
                await asyncio.sleep(0.1)
            return trajs
        for k, v in enumerate(HOLD_FROM):
            while newest >= v and not os.path.exists(RELEASE + (str(k) if k else "")):
                await asyncio.sleep(0.1)
        return trajs


register_agent("hold-math", HoldAgent)
'''


class Hold:
    """Keeps a run from training past step `hold_from` until `release()`: the test's injections happen while the
    run is known to be training, however fast the machine is."""

    def __init__(self, tmp_dir: str, hold_from: int | tuple[int, ...], hold_process: str = "") -> None:
        """`hold_from`: a version, or several, each released by its own `release(k)`; `hold_process`
        ("rollout1=2"): every group of that rollout process is held until `release(k)` instead (`held(process)` says
        one is)."""
        self.dir = os.path.join(tmp_dir, "hold")
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "hold_agent.py"), "w") as f:
            f.write(HOLD_MODULE)
        self.flag = os.path.join(self.dir, "release")
        # a held run is stalled on purpose (no group finishes until the test says so): not the stall rule's case
        self.args = ["imports=[hold_agent]", "agent.name=hold-math", "rollout.max_no_progress_s=3600"]
        versions = hold_from if isinstance(hold_from, tuple) else (hold_from,)
        self.env = {"ARL_TEST_RELEASE": self.flag, "ARL_TEST_HOLD_FROM": ",".join(map(str, versions)),
                    "ARL_TEST_HOLD_PROCESS": hold_process,
                    "PYTHONPATH": os.pathsep.join([self.dir, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}

    def release(self, k: int = 0) -> None:
        open(self.flag + (str(k) if k else ""), "w").close()

    def held(self, process: str) -> bool:
        return os.path.exists(self.flag + ".held." + process)


_STARTED: list[subprocess.Popen] = []  # every launcher start_run started, for stop_runs_left_running


def start_run(run_root: str, cache: str, extra: list[str], cwd: str = ROOT,
              env: Optional[dict[str, str]] = None) -> tuple[subprocess.Popen, str]:
    """Start the launcher; its stderr (the controller's log) goes to a file that `launcher_log` reads while it
    runs (a pipe would only be readable at the end, and could fill up)."""
    cmd = [sys.executable, MAIN, f"run_dir={run_root}", "run_name=run", f"model.cache_dir={cache}", *TINY, *extra]
    full_env = {**os.environ, **(env or {})}
    os.makedirs(run_root, exist_ok=True)
    err_path = os.path.join(run_root, "launcher.stderr")
    with open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=err, text=True, env=full_env)
    proc.stderr_path = err_path  # type: ignore[attr-defined]
    _STARTED.append(proc)
    return proc, os.path.join(run_root, "run")


def stop_runs_left_running() -> int:
    """Stop (SIGINT: the launcher stops its roles) every run `start_run` started that is still running: a test
    that fails before its `finish` (a held run never ends by itself) must not leave processes behind."""
    left = [p for p in _STARTED if p.poll() is None]
    for p in left:
        stop(p)
    _STARTED.clear()
    return len(left)


def launcher_log(proc: subprocess.Popen) -> str:
    """What the launcher (and its controller) wrote to stderr so far."""
    with open(proc.stderr_path, errors="replace") as f:  # type: ignore[attr-defined]
        return f.read()


def finish(proc: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"run did not finish in {timeout}s\nstderr:\n{launcher_log(proc)[-5000:]}")
    return proc.returncode, out, launcher_log(proc)


def wait_for(pred: Callable[[], bool], proc: subprocess.Popen, timeout: float = 600, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            proc.communicate()
            raise AssertionError(f"run exited ({proc.returncode}) while waiting for {what}\n"
                                 f"{launcher_log(proc)[-5000:]}")
        if pred():
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"timed out waiting for {what}")


_SUPPRESSED = re.compile(r"\(\+(\d+) similar suppressed\)\s*$")


def malformed_dropped(log: str, address: str) -> int:
    """Messages the socket at `address` has dropped as malformed so far, read from its warnings in `log` (the
    role's log text). A socket logs at most one warning a second; each warning line stands for one message, and
    ``(+N similar suppressed)`` on it for the N it held back since the previous line (so the last second's drops
    show only with the socket's next warning)."""
    n = 0
    for line in log.splitlines():
        if "arl.transport" not in line or address not in line:
            continue
        m = _SUPPRESSED.search(line)
        n += (1 if "dropped malformed message" in line else 0) + (int(m.group(1)) if m else 0)
    return n


def wait_malformed_drained(proc: subprocess.Popen, targets: dict[str, tuple[Callable[[], str], str, int]],
                           timeout: float = 300) -> dict[str, int]:
    """Wait until every target socket has dropped as many malformed messages as were sent to it: `targets` maps a
    name to (its log text reader, its bound address, messages sent). While one falls short, one more malformed
    message goes to it every 1.2 s (a warning after the socket's 1 s quiet time, which reports what it held back);
    it is counted in what that socket must reach. Returns the nudges sent per target."""
    import zmq

    ctx = zmq.Context()
    kinds = {"learner": zmq.PUSH}
    socks = {}
    nudged = {name: 0 for name in targets}
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"run exited ({proc.returncode}) before its sockets drained the malformed "
                                     f"frames\n{launcher_log(proc)[-3000:]}")
            counts = {name: malformed_dropped(read(), address) for name, (read, address, _) in targets.items()}
            short = [name for name, (_, _, sent) in targets.items() if counts[name] < sent + nudged[name]]
            if not short:
                return nudged
            if time.monotonic() > deadline:
                raise AssertionError(f"sockets did not drop every malformed message within {timeout:g}s: dropped "
                                     f"{counts}, sent {({n: t[2] + nudged[n] for n, t in targets.items()})}")
            for name in short:
                if name not in socks:
                    socks[name] = ctx.socket(kinds.get(name, zmq.DEALER))
                    socks[name].setsockopt(zmq.LINGER, 0)
                    socks[name].connect(targets[name][1])
                socks[name].send(b"\xc1 not msgpack")
                nudged[name] += 1
            time.sleep(1.2)  # the poll interval: past the socket's 1 s quiet time, so the nudge is logged
    finally:
        for sock in socks.values():
            sock.close()
        ctx.term()


def read_metrics(run_dir: str) -> list[dict]:
    return read_jsonl(os.path.join(run_dir, "metrics.jsonl"))  # a line being written is skipped


def train_steps(run_dir: str) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir) if m.get("type") == "train"]


def summary(run_dir: str) -> dict:
    recs = [m for m in read_metrics(run_dir) if m.get("type") == "summary"]
    assert recs, "the run wrote no summary record"
    return recs[-1]


def addresses(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "addresses.json")) as f:
        return json.load(f)


def role_pids(run_dir: str) -> dict[str, int]:
    """role name (inference0, learner0, rollout1, ...) -> pid of this run's live role processes."""
    pids = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "arl.launch.role" in argv and run_dir in argv:
            role = argv[argv.index("--role") + 1] + argv[argv.index("--index") + 1]
            pids[role] = int(pid)
    return pids


def log_text(run_dir: str, name: str) -> str:
    with open(os.path.join(run_dir, "logs", f"{name}.log"), errors="replace") as f:
        return f.read()


def assert_no_leftovers(run_dir: str) -> None:
    """Every role process of the run exits (they may still be on their way out when the launcher returns)."""
    wait_until(lambda: role_pids(run_dir) == {}, 30, f"the roles of {run_dir} to exit")


def assert_accounting(s: dict) -> None:
    """Nothing accepted was lost or trained twice: every group the controller accepted reached the learner, and
    each one the learner received was trained, dropped (stale/invalid) or is still buffered."""
    learner = s["learner"]
    assert s.get("lost_accepted_groups") == 0, s
    assert learner["trained_twice"] == 0, s
    assert s.get("learner_balance") == 0, s


def record(test: str, fault: str, injected: int, run_dir: str, finished: bool, **extra) -> None:
    """Append this test's figures to $ARL_FAULT_RESULTS (a jsonl file) for scripts/fault_report.py."""
    path = os.environ.get("ARL_FAULT_RESULTS")
    if not path:
        return
    try:
        s = summary(run_dir)
    except (AssertionError, OSError):
        s = {}
    row = {"test": test, "fault": fault, "injected": injected, "finished": finished,
           "accepted_groups": s.get("accepted_groups"), "accepted_trajectories": s.get("accepted_trajectories"),
           "learner": s.get("learner", {}), "lost_accepted_groups": s.get("lost_accepted_groups"),
           "learner_balance": s.get("learner_balance"), "steps": s.get("steps"), "faults": s.get("faults", []),
           "groups": s.get("groups", {}), **extra}
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
