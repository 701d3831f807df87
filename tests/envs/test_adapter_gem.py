"""GEM adapter: a GEM game (GuessTheNumber: text observations, text actions) through every role."""

from __future__ import annotations

import asyncio
import math

import pytest

pytest.importorskip("gem")

from arl.envs.gem_env import GemEnv  # noqa: E402
from tests.e2e.test_end_to_end import model_cache  # noqa: E402,F401 - the session's warm tiny model
from tests.envs.adapter_run import env_steps_and_rewards, refused, run_adapter, traces  # noqa: E402

GAME = "game:GuessTheNumber-v0-easy"
# the f-string leaves '\\boxed{{action}}', as on the command line in docs/environments.md (GEM reads \\boxed{7})
ARGS = ["env.name=gem", f"env.args={{id: '{GAME}', action_regex: '\\d+', action_template: '\\boxed{{{{action}}}}',"
        " max_obs_chars: 60}", "dataset.name=env-seeds", "dataset.train_size=64", "dataset.test_size=4",
        "agent.args={max_turns: 4, max_total_tokens: 220}", "rollout.trace_rate=1.0"]


def test_guess_the_number_wraps_the_answer_and_ends_on_the_right_guess():
    async def go() -> None:
        env = GemEnv(id=GAME, action_regex=r"\d+", action_template="\\boxed{{action}}", max_obs_chars=60)
        obs, _ = await env.reset(options={"seed": 7})
        assert len(obs) <= 60
        lo, hi = 1, 10
        for _ in range(4):  # bisect with the game's hints
            guess = (lo + hi) // 2
            obs, reward, terminated, _, _ = await env.step(f"{guess}")
            if terminated:
                break
            lo, hi = (guess + 1, hi) if "higher" in obs else (lo, guess - 1)
        assert terminated and reward > 0, obs
        obs, reward, terminated, _, info = await env.step("no number")  # refused before the game sees it
        assert info["invalid_action"] and reward == 0.0
        await env.close()
    asyncio.run(go())


def test_unknown_game_and_wrapper_are_refused_at_startup_with_the_name():
    p = refused(["env.name=gem", "env.args={id: 'game:NoSuchGame-v0'}", "agent.name=env-chat",
                 "dataset.name=env-seeds"])
    assert p.returncode == 2 and "game:NoSuchGame-v0" in p.stderr, p.stderr[-2000:]
    with pytest.raises(ValueError, match="no_such_wrapper"):
        GemEnv(id=GAME, wrappers=["no_such_wrapper"])


@pytest.mark.slow
def test_gem_game_trains_with_rewards_in_the_train_records(tmp_path, model_cache):  # noqa: F811
    run_dir, train = run_adapter(tmp_path, model_cache, ARGS)
    steps, rewards = env_steps_and_rewards(train)
    assert steps >= 20, steps
    assert all(math.isfinite(r) for r in rewards), rewards
    t = [x for x in traces(run_dir) if x.get("reward") is not None]
    assert t and all(len(x["turn_rewards"]) == x["metadata"]["turns"] for x in t)
    assert any(x["metadata"]["turns"] >= 2 for x in t)  # wrong guesses: the game's hint went back in
