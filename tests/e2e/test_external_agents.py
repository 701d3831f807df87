"""Agents in another language and outside the run. The JavaScript agent of examples/node (the `openai` npm
package) runs as a subprocess agent (a Python agent function starts it per session) and, the same program, trains
end to end as an external agent through the task API (`agent.name=external`), with one of its two processes (a slow
one) killed while it holds episodes: their groups are dropped at the deadline, the run finishes and no accepted
group is lost."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.test_end_to_end import (MAIN, ROOT, SMALL, assert_clean_run, assert_ledger_checked,  # noqa: F401
                                       model_cache, read_metrics)

NODE_DIR = os.path.join(ROOT, "examples", "node")
AGENT_JS = os.path.join(NODE_DIR, "agent.mjs")

@pytest.fixture(scope="module")
def node_agent() -> str:
    """examples/node with its `openai` package installed (npm install, once)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node.js and npm are not installed (apt-get install nodejs npm)")
    if not os.path.isdir(os.path.join(NODE_DIR, "node_modules", "openai")):
        subprocess.run(["npm", "install", "--no-audit", "--no-fund"], cwd=NODE_DIR, check=True, timeout=300,
                       capture_output=True)
    return AGENT_JS


def summary(run_dir: str) -> dict:
    (s,) = [m for m in read_metrics(run_dir) if m["type"] == "summary"]
    return s


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_the_node_agent_as_a_subprocess_agent_makes_ledger_exact_trajectories(node_agent):
    """A Python agent function starts the JavaScript program per session with the session's OPENAI_BASE_URL /
    OPENAI_API_KEY; it answers over the socket with the openai npm package, and the env scores what it printed.
    The rollout worker's path (`run_agent`, the group's sessions, the token ledger) without the other roles: what
    is particular to a subprocess agent is all here; the training around it is every endpoint agent's (the
    external-agent test below trains the same program)."""
    from arl.api import GenerationConfig
    from arl.envs.math import MathEnv
    from arl.rollout.endpoint import EndpointServer
    from arl.rollout.ledger import EngineLog, verify_trajectory
    from arl.rollout.openai_agent import EndpointAgent
    from arl.rollout.worker import run_agent
    from tests.rollout.test_openai_agent import EOS, PROMPT, TOK, Client

    async def node_math(base_url, api_key, prompt, env):
        proc = await asyncio.create_subprocess_exec(
            "node", node_agent, "--prompt", prompt["prompt"], stdout=asyncio.subprocess.PIPE,
            env={**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key})
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        return None  # the env scores the session's last answer

    server = EndpointServer(TOK, GenerationConfig(max_new_tokens=8, stop_token_ids=[EOS]), max_context_len=256)
    log = EngineLog()
    try:
        trajs = await run_agent(EndpointAgent(node_math, server, group_size=2), dict(PROMPT), MathEnv(), Client(),
                                60.0, engine_log=log)
    finally:
        await server.close()
    assert len(trajs) == 2 and server.stats["requests"] == 2 and server.slots.running == 0
    for t in trajs:
        verify_trajectory(t, log)
        assert t.reward == 0.0 and t.metadata["turns"] == 1  # the client answers "18" to 12+7


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_node_agent_trains_from_outside_the_run_and_one_killed_loses_nothing(tmp_path, model_cache,
                                                                                   node_agent):
    steps = 40  # enough that training episodes are still being handed out when the slow agent joins
    run_dir = str(tmp_path / "runs" / "run")
    cmd = [sys.executable, MAIN, f"run_dir={tmp_path / 'runs'}", "run_name=run", f"model.cache_dir={model_cache}",
           "agent.name=external", f"total_train_steps={steps}", *SMALL, "rollout.trajectory_timeout=20", "eval.every_n_steps=40"]
    run = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    agents = [subprocess.Popen(["node", node_agent, "--run-dir", run_dir, "--concurrency", "8"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and run.poll() is None:  # training is under way
            if any(m["type"] == "train" for m in read_metrics_safe(run_dir)):
                break
            time.sleep(0.5)
        # a second agent takes 4 training episodes, thinks for a minute over each, and is killed holding them
        agents.append(subprocess.Popen(["node", node_agent, "--run-dir", run_dir, "--concurrency", "4",
                                        "--delay-ms", "60000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True))
        time.sleep(3.0)
        os.kill(agents[1].pid, signal.SIGKILL)
        out, err = run.communicate(timeout=600)
    finally:
        for p in (run, *agents):
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
    proc = subprocess.CompletedProcess(cmd, run.returncode, out, err)
    assert_clean_run(proc, run_dir, steps)
    assert_ledger_checked(run_dir)
    s = summary(run_dir)
    assert s["lost_accepted_groups"] == 0 and s["groups"].get("timeout", 0) >= 1, s
    episodes = [m for m in read_metrics(run_dir) if m["type"] == "eval"][-1]["roles"]["rollout0"]["endpoint"]
    assert episodes["episodes"]["rewarded"] > 0 and episodes["episodes"]["expired_claimed"] >= 1, episodes


def read_metrics_safe(run_dir: str) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except (FileNotFoundError, ValueError):
        return []
