import logging
import time

import pytest

from arl.envs.math import REWARD_TIMEOUTS, MathEnv


def stuck_reward(completion, answer):
    time.sleep(1.0)
    return 1.0


@pytest.mark.asyncio
async def test_hung_reward_is_named_with_its_stack(caplog):
    env = MathEnv(reward_fn=stuck_reward, timeout=0.05)
    await env.reset(options={"answer": "3"})
    with caplog.at_level(logging.WARNING, logger="arl.envs.math"):
        _, reward, _, _, info = await env.step("3")
    assert reward == 0.0 and "timed out" in info["error"] and "stuck_reward" in info["error"]
    name = f"{__name__}:stuck_reward"
    assert REWARD_TIMEOUTS[name] >= 1
    text = caplog.text
    assert f"reward function {name} timed out after 0.05s" in text and "time.sleep(1.0)" in text
