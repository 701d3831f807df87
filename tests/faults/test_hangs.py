"""Hangs in user code during a real run, with a user environment loaded through imports=[...]:

* an env whose step never returns for some prompts: the guard's deadline (rollout.env_timeout) drops those groups
  with reason env_timeout:step, their budget goes back, and the worker goes on;
* one env step that blocks the rollout worker's event loop (time.sleep): its heartbeats stop, the controller names
  it with what it was waiting on, has it dump its Python stacks into its log, kills and restarts it;
* a reward function that hangs for some answers: the math env's reward timeout gives reward 0, and the rollout
  worker's log names the function and shows where it hangs.
"""

from __future__ import annotations

import os
import textwrap

import pytest

from .harness import (assert_accounting, assert_no_leftovers, finish, log_text, record, start_run, summary,
                      train_steps)

USER_MODULE = '''
import asyncio
import os
import time

from arl.api import register_env
from arl.envs.math import MathEnv, exact_number_match

MARKER = os.environ["HANG_MARKER"]


def slow_reward(completion, answer):
    """Hangs (well past the env's reward timeout) for answers that are 1 mod 4."""
    if int(answer) % 4 == 1:
        time.sleep(6)
    return exact_number_match(completion, answer)


STEPS = [0]


class HangEnv(MathEnv):
    async def step(self, action):
        STEPS[0] += 1
        if STEPS[0] % 10 == 5:  # every 10th call never answers: the guard's deadline drops its group
            await asyncio.sleep(3600)
        if STEPS[0] >= 40 and not os.path.exists(MARKER):  # once per run, in training: block the event loop
            open(MARKER, "w").close()
            time.sleep(3600)
        return await super().step(action)


register_env("hang-math", HangEnv)
'''

STEPS = 4


@pytest.mark.slow
def test_hung_env_blocked_loop_and_hung_reward(tmp_path, model_cache):
    user = tmp_path / "user"
    user.mkdir()
    (user / "hang_env.py").write_text(textwrap.dedent(USER_MODULE))
    marker = str(tmp_path / "blocked-once")
    proc, run_dir = start_run(
        str(tmp_path / "runs"), model_cache,
        ["imports=[hang_env]", "env.name=hang-math", "env.args={reward_fn: 'hang_env:slow_reward', timeout: 0.5}",
         "agent.name=math-single-step", "rollout.env_timeout=1.0", "rollout.heartbeat_timeout=6",
         f"total_train_steps={STEPS}"],
        cwd=str(user), env={"HANG_MARKER": marker})
    code, _, err = finish(proc)
    assert code == 0, err[-6000:]
    assert train_steps(run_dir) == list(range(1, STEPS + 1))
    assert os.path.exists(marker)
    s = summary(run_dir)
    # 1. hung env steps: groups dropped with their reason, counted in metrics
    assert s["groups"].get("env_timeout:step", 0) >= 1, s["groups"]
    # 2. the blocked worker: named with what it waited on, stacks dumped, restarted, its groups counted as lost
    (silent,) = [f for f in s["faults"] if f["kind"] == "heartbeat_timeout"]
    assert silent["role"] == "rollout0" and silent["stacks_dumped"] and "groups running" in silent["waiting_on"]
    assert [f["kind"] for f in s["faults"]] == ["heartbeat_timeout", "rollout_restart"]
    assert s["rollout_restarts"] == 1 and s["groups"].get("lost_worker_died", 0) == s["lost_in_flight_groups"] >= 1
    assert "role rollout0 sent no heartbeat" in err and "last waiting on: " in err and "Python stacks of rollout0" in err
    log = log_text(run_dir, "rollout0")
    dump = log[log.index("most recent call first"):]
    assert "hang_env.py" in dump and "in step" in dump
    # ... and its loop watchdog had named the blocked line, which the controller's message quotes
    assert "event loop blocked" in silent["loop_blocked"] and "hang_env.py" in silent["loop_blocked"]
    assert "its log says: event loop blocked" in err and "time.sleep(3600)" in log
    # 3. the hung reward function: timed out, named, its stack shown; reward 0 and counted
    assert "reward function hang_env:slow_reward timed out after 0.5s" in log
    assert "time.sleep(6)" in log
    assert s["env"].get("reward_timeout", 0) >= 1
    assert_accounting(s)
    assert_no_leftovers(run_dir)
    n_env = s["groups"].get("env_timeout:step", 0)
    record("test_hangs", "hung env steps, a blocked event loop, a hung reward fn",
           n_env + 1 + s["env"]["reward_timeout"], run_dir, True, crashes=0,
           detail={"env_timeouts": n_env, "reward_timeouts": s["env"]["reward_timeout"], "restarts": 1})
