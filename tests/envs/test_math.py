import asyncio
import threading
import time

import pytest

from arl.api import ENVS, make_env
from arl.envs.math import MathEnv, exact_number_match, inline_reward, is_inline_reward


def slow_reward(completion, answer):
    time.sleep(10)
    return 1.0


def bad_reward(completion, answer):
    raise ZeroDivisionError("boom")


def test_exact_number_match():
    assert exact_number_match("19", "19") == 1.0
    assert exact_number_match(" 19<eos>", "19") == 1.0
    assert exact_number_match("<|assistant|>19.0", "19") == 1.0
    assert exact_number_match("the answer is 19, not 20", "19") == 1.0
    assert exact_number_match("20 or 19", "19") == 0.0
    assert exact_number_match("", "19") == 0.0
    assert exact_number_match("abc", "19") == 0.0
    assert exact_number_match("-3", "-3") == 1.0
    assert exact_number_match("19", "not a number") == 0.0


@pytest.mark.asyncio
async def test_right_and_wrong():
    assert "math" in ENVS
    env = make_env("math")
    await env.reset(options={"answer": "19"})
    obs, r, term, trunc, info = await env.step("19")
    assert (obs, r, term, trunc) == (None, 1.0, True, False) and info == {"correct": True, "error": None}
    _, r, term, _, info = await env.step("18")
    assert r == 0.0 and term is False and info["correct"] is False and info["error"] is None


@pytest.mark.asyncio
async def test_hanging_reward_times_out_quickly():
    env = MathEnv(reward_fn=slow_reward, timeout=0.2)
    await env.reset(options={"answer": "1"})
    t0 = time.perf_counter()
    _, r, term, _, info = await env.step("1")
    assert time.perf_counter() - t0 < 1.5
    assert r == 0.0 and term is False and "timed out" in info["error"]
    # the pool still serves other checks while that thread hangs
    ok = MathEnv(reward_fn=lambda c, a: exact_number_match(c, a), timeout=2.0)
    await ok.reset(options={"answer": "1"})
    results = await asyncio.gather(*(ok.step("1") for _ in range(8)))
    assert all(x[1] == 1.0 for x in results)


@pytest.mark.asyncio
async def test_inline_rewards_run_on_the_loop_others_in_the_pool():
    threads: dict[str, int] = {}

    def pooled(c, a):
        threads["pooled"] = threading.get_ident()
        return 1.0

    @inline_reward
    def inline(c, a):
        threads["inline"] = threading.get_ident()
        return 1.0

    @inline_reward
    def inline_bad(c, a):
        raise ValueError("bad check")

    assert is_inline_reward(exact_number_match) and not is_inline_reward(pooled)
    for fn in (pooled, inline):
        env = MathEnv(reward_fn=fn)
        await env.reset(options={"answer": "1"})
        assert (await env.step("1"))[1] == 1.0
    assert threads["inline"] == threading.get_ident() != threads["pooled"]
    env = MathEnv(reward_fn=inline_bad)  # a marked function that raises is still isolated: reward 0, the error said
    await env.reset(options={"answer": "1"})
    _, r, _, _, info = await env.step("1")
    assert r == 0.0 and "ValueError: bad check" in info["error"]


@pytest.mark.asyncio
async def test_raising_reward_and_string_reward_fn():
    env = MathEnv(reward_fn="tests.envs.test_math:bad_reward")
    await env.reset(options={"answer": "1"})
    _, r, _, _, info = await env.step("1")
    assert r == 0.0 and "ZeroDivisionError" in info["error"]
    with pytest.raises(ValueError, match="no attribute"):
        MathEnv(reward_fn="arl.envs.math:nope")
    with pytest.raises(ValueError, match="cannot import"):
        MathEnv(reward_fn="no_such_module_xyz:f")


@pytest.mark.asyncio
async def test_no_reset_and_bad_action_and_async_fn():
    env = MathEnv()
    _, r, _, _, info = await env.step("1")
    assert r == 0.0 and "reset" in info["error"]
    await env.reset(options={"answer": 3})
    _, r, _, _, info = await env.step(["3"])
    assert r == 0.0 and "str" in info["error"]

    async def half(c, a):
        return 0.5

    env = MathEnv(reward_fn=half, correct_threshold=0.5)
    await env.reset(options={"answer": "3"})
    _, r, term, _, info = await env.step("x")
    assert r == 0.5 and term and info["correct"]
