"""gymnasium adapter: a toy-text env (FrozenLake, Discrete observations and actions) through every role."""

from __future__ import annotations

import asyncio
import math

import pytest

pytest.importorskip("gymnasium")

from arl.envs.gymnasium_env import GymnasiumEnv  # noqa: E402
from tests.e2e.test_end_to_end import model_cache  # noqa: E402,F401 - the session's warm tiny model
from tests.envs.adapter_run import env_steps_and_rewards, refused, run_adapter, traces  # noqa: E402

ARGS = ["env.name=gymnasium", "env.args={id: FrozenLake-v1, make_args: {is_slippery: false}, action_regex: '[0-3]'}",
        "dataset.name=env-seeds", "dataset.train_size=64", "dataset.test_size=4",
        "agent.args={max_turns: 6, max_total_tokens: 200, instructions: 'Move 0 left 1 down 2 right 3 up. '}",
        "rollout.trace_rate=1.0"]


def test_frozenlake_steps_parse_actions_and_refuse_bad_text():
    async def go() -> None:
        env = GymnasiumEnv(id="FrozenLake-v1", make_args={"is_slippery": False}, action_regex="[0-3]")
        obs, _ = await env.reset(options={"seed": 3})
        assert obs == "state 0"
        assert (await env.step("<|assistant|>2"))[:4] == ("state 1", 0.0, False, False)  # right
        obs, reward, terminated, _, info = await env.step("no move here")
        assert (obs, reward, terminated, info["invalid_action"]) == ("state 1", 0.0, False, True)
        path = ["2", "1", "1", "1", "2"]  # right down down down right: the goal (state 15)
        for a in path:
            obs, reward, terminated, _, _ = await env.step(a)
        assert (obs, reward, terminated) == ("state 15", 1.0, True)
        await env.close()

        names = GymnasiumEnv(id="FrozenLake-v1", make_args={"is_slippery": False},
                             action_names=["left", "down", "right", "up"])
        await names.reset(seed=0)
        assert (await names.step("I go down"))[0] == "state 4"
        box = GymnasiumEnv(id="Pendulum-v1")
        obs, _ = await box.reset(seed=0)
        assert len(obs.split()) == 3
        obs, reward, *_ = await box.step("torque 0.5")
        assert math.isfinite(reward) and len(obs.split()) == 3
    asyncio.run(go())


def test_unknown_env_id_is_refused_at_startup_with_the_id():
    p = refused(["env.name=gymnasium", "env.args={id: NoSuchLake-v9}", "agent.name=env-chat",
                 "dataset.name=env-seeds"])
    assert p.returncode == 2 and "NoSuchLake-v9" in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("where", [[], ["env.servers=1"]], ids=["in_process", "env_server"])
def test_frozenlake_trains_with_rewards_in_the_train_records(tmp_path, model_cache, where):  # noqa: F811
    run_dir, train = run_adapter(tmp_path, model_cache, [*ARGS, *where])
    steps, rewards = env_steps_and_rewards(train)
    assert steps >= 20, steps
    assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in rewards), rewards
    t = [x for x in traces(run_dir) if x.get("reward") is not None]
    assert t and all("turn_rewards" in x for x in t)
    assert any(x["metadata"].get("turns", 0) >= 2 for x in t)  # multi-turn episodes: observations went back in
