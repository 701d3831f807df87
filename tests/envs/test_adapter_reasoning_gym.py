"""reasoning-gym adapter: two tasks as the data set and as the reward (score_answer), through every role."""

from __future__ import annotations

import asyncio
import math

import pytest

pytest.importorskip("reasoning_gym")

from arl.envs.reasoning_gym_env import ReasoningGymEnv, reasoning_gym_splits  # noqa: E402
from tests.e2e.test_end_to_end import model_cache  # noqa: E402,F401 - the session's warm tiny model
from tests.envs.adapter_run import env_steps_and_rewards, refused, run_adapter, traces  # noqa: E402

TASKS = ["chain_sum", "basic_arithmetic"]


def test_rows_carry_questions_and_answers_and_the_env_scores_with_the_task():
    train, test = reasoning_gym_splits(TASKS, train_size=6, test_size=3, seed=0)
    assert len(train) == 12 and len(test) == 6
    assert {r["rg_task"] for r in train} == set(TASKS)
    assert not {r["id"] for r in train} & {r["id"] for r in test}

    async def go() -> None:
        env = ReasoningGymEnv()
        for row in train[:2] + train[-2:]:
            obs, _ = await env.reset(options=row)
            assert obs == row["prompt"]
            _, reward, terminated, _, info = await env.step(f"{row['answer']}<eos>")
            assert (reward, terminated, info["correct"]) == (1.0, True, True)
            _, reward, _, _, info = await env.step("not it")
            assert reward == 0.0 and not info["correct"]
        fresh = ReasoningGymEnv()
        _, reward, _, _, info = await fresh.step("1")
        assert reward == 0.0 and "reset" in info["error"]
    asyncio.run(go())


def test_unknown_task_is_refused_at_startup_with_the_name():
    p = refused(["dataset.name=reasoning-gym", "dataset.tasks=[chain_sum,no_such_task]", "env.name=reasoning-gym"])
    assert p.returncode == 2 and "no_such_task" in p.stderr, p.stderr[-2000:]


@pytest.mark.slow
def test_two_tasks_train_with_rewards_in_the_train_records(tmp_path, model_cache):  # noqa: F811
    run_dir, train = run_adapter(tmp_path, model_cache, [
        "dataset.name=reasoning-gym", f"dataset.tasks=[{','.join(TASKS)}]", "dataset.train_size=50",
        "dataset.test_size=4", "env.name=reasoning-gym", "agent.args={max_turns: 1, max_total_tokens: 200}",
        "rollout.trace_rate=1.0"], steps=4)
    steps, rewards = env_steps_and_rewards(train)
    assert steps >= 20, steps
    assert all(math.isfinite(r) and 0.0 <= r <= 1.0 for r in rewards), rewards
    seen = {str(x.get("prompt_id", "")).split("-")[0] for x in traces(run_dir)}
    assert set(TASKS) <= seen, seen
