"""No silent spinning: a real run whose every group is dropped stops by itself, exits non-zero, writes its summary,
and the console (the launcher's stderr) names the reason, with the drop counts in the progress line, and says the
newest error's own message and where it was raised (not only its class).

* an env whose reward is never a number (NaN): every group is dropped as env_error:step:BadReward, and the run stops
  after `rollout.max_consecutive_drops` of them in a row;
* an env whose step always raises: the run stops once no group was accepted for `rollout.max_no_progress_s`.
"""

from __future__ import annotations

import textwrap

import pytest

from .harness import assert_no_leftovers, finish, start_run, summary, train_steps

USER_MODULE = '''
from arl.api import register_env
from arl.envs.math import MathEnv


class NaNRewardEnv(MathEnv):
    async def step(self, action):
        obs, _, terminated, truncated, info = await super().step(action)
        return obs, float("nan"), terminated, truncated, info


class RaisingEnv(MathEnv):
    async def step(self, action):
        raise ValueError("the reward service is down")


register_env("nan-reward", NaNRewardEnv)
register_env("raising", RaisingEnv)
'''

CASES = {
    "nan-reward": (["rollout.max_consecutive_drops=20", "rollout.max_no_progress_s=0"],
                   "prompt groups were all dropped for 'env_error:step:BadReward' (rollout.max_consecutive_drops=20)",
                   ["its newest error:\nNaNRewardEnv.step returned a non-finite or non-numeric reward nan"]),
    "raising": (["rollout.max_consecutive_drops=0", "rollout.max_no_progress_s=8"],
                "most for 'env_error:step:ValueError'",
                ["its newest error:\nRaisingEnv.step raised ValueError: the reward service is down\n"
                 "raised at (innermost last):\n", 'in step\n    raise ValueError("the reward service is down")']),
}


@pytest.mark.slow
@pytest.mark.parametrize("env_name", sorted(CASES))
def test_a_run_that_drops_everything_stops_and_says_why(tmp_path, model_cache, env_name):
    user = tmp_path / "user"
    user.mkdir()
    (user / "bad_env.py").write_text(textwrap.dedent(USER_MODULE))
    limits, reason, detail = CASES[env_name]
    proc, run_dir = start_run(str(tmp_path / "runs"), model_cache,
                              ["imports=[bad_env]", f"env.name={env_name}", "agent.name=math-single-step",
                               "total_train_steps=4", "progress=true", *limits], cwd=str(user))
    code, _, err = finish(proc, timeout=600)
    assert code == 1, err[-6000:]
    assert "run failed: the run is making no progress" in err and reason in err
    assert all(d in err for d in detail), err[-3000:]  # the error itself, not only its class
    assert "dropped=env_error:step:" in err  # the progress line's drop counts by reason
    if env_name == "raising":  # before it stops (a fifth of max_no_progress_s): a warning naming the top reason
        assert "warning: no learner step for" in err and "top reason 'env_error:step:ValueError'" in err
    s = summary(run_dir)
    assert not s["finished"] and reason in s["failure"] and train_steps(run_dir) == []
    assert s["accepted_groups"] == 0 and sum(n for k, n in s["groups"].items() if k.startswith("env_error")) >= 1
    assert_no_leftovers(run_dir)
