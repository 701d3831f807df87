"""End-to-end: the real launcher starts every role as an OS process on the tiny model and trains a few steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.waiting import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = os.path.join(ROOT, "training", "main_async_ppo.py")

SMALL = [
    "learner.batch_size=2",
    "agent.group_size=4",
    "rollout.max_concurrent_rollouts=8",
    "eval.max_prompts=16",
    "eval.every_n_steps=2",
    "progress=false",
    "startup_timeout=240",
    "rollout.verify_token_ledger=true",  # every trajectory = engine tokens + declared insertions, or the run fails
]


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> str:
    """One warm-up per test session, shared by every run."""
    return str(tmp_path_factory.mktemp("arl-cache"))


def run_main(args: list[str], run_root: str, cache: str, cwd: str = ROOT, timeout: float = 400) -> tuple[
        subprocess.CompletedProcess, str]:
    cmd = [sys.executable, MAIN, f"run_dir={run_root}", "run_name=run", f"model.cache_dir={cache}", *args]
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    return proc, os.path.join(run_root, "run")


def read_metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def leftover_processes(run_dir: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if run_dir in cmd and "arl.launch.role" in cmd:
            out.append(f"{pid}: {cmd}")
    return out


def assert_clean_run(proc: subprocess.CompletedProcess, run_dir: str, steps: int) -> list[dict]:
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    metrics = read_metrics(run_dir)
    train = [m for m in metrics if m["type"] == "train"]
    assert [m["step"] for m in train] == list(range(1, steps + 1))
    evals = [m for m in metrics if m["type"] == "eval"]
    assert evals[0]["version"] == 0 and evals[-1]["version"] == steps
    wait_until(lambda: leftover_processes(run_dir) == [], 30, f"the roles of {run_dir} to exit")
    return train


def assert_ledger_checked(run_dir: str) -> dict:
    """The token ledger check ran on the trajectories (rollout0's counters in the last eval record's role stats)."""
    evals = [m for m in read_metrics(run_dir) if m["type"] == "eval"]
    stats = evals[-1].get("roles", {}).get("rollout0", {})
    assert stats.get("ledger_checked", 0) > 0 and stats.get("ledger_failures", 0) == 0, stats
    return stats


@pytest.mark.slow
@pytest.mark.parametrize("eta", [0, 2])
def test_trains_with_every_role_as_a_process_and_bounded_staleness(tmp_path, model_cache, eta):
    steps = 4
    proc, run_dir = run_main([f"total_train_steps={steps}", f"max_head_offpolicyness={eta}", *SMALL],
                             str(tmp_path), model_cache)
    train = assert_clean_run(proc, run_dir, steps)
    for m in train:
        assert m["head_offpolicyness"] <= eta, m
        assert m["tail_offpolicyness"] <= m["head_offpolicyness"]
        assert m["staleness_violations"] == 0
        assert m["n_seqs"] >= 2 * 4
    if eta == 0:
        assert all(m["head_offpolicyness"] == 0 for m in train)
    assert_ledger_checked(run_dir)
    logs = os.listdir(os.path.join(run_dir, "logs"))
    assert sorted(logs) == ["inference0.log", "learner.log", "rollout0.log"]
    with open(os.path.join(run_dir, "logs", "learner.log")) as f:
        assert "deepspeed" in f.read().lower()


USER_MODULE = '''
import asyncio
from arl.api import Agent, EnvironmentService, GenerateRequest, TrajectoryBuilder, register_agent, register_env


class CountEnv(EnvironmentService):
    """Reward: how close the number of generated tokens is to 3."""

    async def step(self, action):
        return None, 1.0 / (1 + abs(len(action) - 3)), True, False, {}


class ShortAgent(Agent):
    def __init__(self, tokenizer, gconfig, group_size=4):
        self.tok, self.gconfig, self.group_size = tokenizer, gconfig, group_size

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        ids = self.tok.apply_chat_template([{"role": "user", "content": prompt["prompt"]}],
                                           add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
        # the AReaL-style tuple form of the obs_queue contract
        await obs_queue.put((prompt["id"], ids, self.gconfig.new(n=self.group_size)))
        resp = await act_queue.get()
        out = []
        for s in resp.samples:
            _, r, *_ = await env.step(s.output_ids.tolist())
            b = TrajectoryBuilder(ids)
            b.add_generated(s)
            out.append(b.build(reward=r, group_id=prompt["id"], metadata={"first_correct": r == 1.0,
                                                                          "solved": r == 1.0}))
        return out


register_agent("user-short", ShortAgent)
register_env("user-count", CountEnv)
'''


@pytest.mark.slow
def test_user_agent_from_outside_the_package(tmp_path, model_cache):
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    (user_dir / "my_agents.py").write_text(textwrap.dedent(USER_MODULE))
    proc, run_dir = run_main(["imports=[my_agents]", "agent.name=user-short", "env.name=user-count",
                              "total_train_steps=2", "busy_poll_us=200", *SMALL], str(tmp_path / "runs"),
                             model_cache, cwd=str(user_dir))
    assert_clean_run(proc, run_dir, 2)
    assert_ledger_checked(run_dir)
    for role in ("inference0", "rollout0", "learner"):  # every role ran on the polling event loop
        with open(os.path.join(run_dir, "logs", f"{role}.log")) as f:
            assert "busy poll 200 us" in f.read(), role


@pytest.mark.slow
def test_tool_agent_with_env_groups_filters_and_ledger(tmp_path, model_cache):
    """The tool agent (calculator + sandboxed python) through every role, with pooled env groups (2 tags), the
    void-turn and success-rate filters and the ledger check. The a+b model writes no tool calls (its tokenizer
    lacks the characters); the tool-calc experiment is the learning demo."""
    args = ["agent.name=tool-agent", "agent.args={tools: [calculator, python], max_turns: 2, max_total_tokens: 64,"
            " answer_regex: '\\d', tool_kwargs: {python: {timeout: 2.0}}}", "rollout.num_env_groups=4",
            "rollout.tags=[math,math2]", "rollout.env_configs={math2: {name: math, args: {timeout: 10.0}}}",
            "rollout.max_env_num_per_worker=16", "rollout.filter_void_turns=true",
            "rollout.filter_uniform_groups=true", "total_train_steps=2", *SMALL]
    proc, run_dir = run_main(args, str(tmp_path), model_cache)
    train = assert_clean_run(proc, run_dir, 2)
    assert_ledger_checked(run_dir)
    # each train record carries the means over the groups finished since the previous one (none, if the groups a
    # step trains on were all in before the previous record): together they cover at least the trained groups
    rollouts = [m["rollout"] for m in train if m["rollout"]]
    assert sum(r["n_traj"] for r in rollouts) >= 2 * 2 * 4, [m["rollout"] for m in train]
    for r in rollouts:
        assert "tool_calls" in r and "void_turns" in r, r
    evals = [m for m in read_metrics(run_dir) if m["type"] == "eval"]
    assert "tool_calls" in evals[-1]["traj_means"]


def test_bad_key_and_unknown_agent_fail_fast():
    p = subprocess.run([sys.executable, MAIN, "bogus.key=1"], capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "bogus.key" in p.stderr
    p = subprocess.run([sys.executable, MAIN, "agent.name=nope"], capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "nope" in p.stderr and "math-multi-turn" in p.stderr
    p = subprocess.run([sys.executable, MAIN, "learner.optimizer.lr=fast"], capture_output=True, text=True, timeout=30)
    assert p.returncode != 0 and "learner.optimizer.lr" in p.stderr and "float" in p.stderr


def _start_background(run_root: str, cache: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, MAIN, f"run_dir={run_root}", "run_name=run", f"model.cache_dir={cache}",
           "total_train_steps=100000", *SMALL, *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, os.path.join(run_root, "run")


def _wait_for_training(run_dir: str, proc: subprocess.Popen, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    path = os.path.join(run_dir, "metrics.jsonl")
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if os.path.exists(path) and any('"train"' in line for line in open(path)):
            return
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("training did not start")


def _worker_pids(run_dir: str) -> dict[str, int]:
    pids = {}
    for line in leftover_processes(run_dir):
        pid, cmd = line.split(":", 1)
        role = cmd.split("--role ")[1].split()[0] + cmd.split("--index ")[1].split()[0]
        pids[role] = int(pid)
    return pids


@pytest.mark.slow
def test_ctrl_c_stops_every_process(tmp_path, model_cache):
    import signal

    proc, run_dir = _start_background(str(tmp_path), model_cache, [])
    _wait_for_training(run_dir, proc)
    assert len(_worker_pids(run_dir)) == 3
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=10)  # the controller itself is gone within 10 s ...
    assert proc.returncode != 0
    assert leftover_processes(run_dir) == []  # ... and so is every role


@pytest.mark.slow
def test_dead_role_stops_the_run_naming_it(tmp_path, model_cache):
    import signal

    proc, run_dir = _start_background(str(tmp_path), model_cache, ["learner.max_restarts=0"])  # else restarted
    _wait_for_training(run_dir, proc)
    os.kill(_worker_pids(run_dir)["learner0"], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "role learner exited with code -9" in err and "learner.log" in err
    assert leftover_processes(run_dir) == []
