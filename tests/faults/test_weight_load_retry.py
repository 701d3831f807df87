"""A weight load that raises does not end a run with one inference server: the server acks the failure, the
controller sends it the newest version again, and the run finishes (simulated engines, so it is quick)."""

from __future__ import annotations

import textwrap

import pytest

from .harness import assert_accounting, assert_no_leftovers, finish, start_run, summary, train_steps

FLAKY_BACKEND = '''
from arl.inference.factory import BACKENDS, _sim_engine


def flaky(model_path, inference, *, seed, index, run_dir):
    """The simulated engine, except that its first weight load raises."""
    engine = _sim_engine(model_path, inference, seed=seed, index=index, run_dir=run_dir)
    real, calls = engine.update_weights, []

    async def update_weights(source, version):
        calls.append(version)
        if len(calls) == 1:
            raise OSError(f"flaky read of v{version}")
        await real(source, version)

    engine.update_weights = update_weights
    return engine


BACKENDS.register("flaky-sim", flaky)
'''


@pytest.mark.slow
def test_a_load_that_fails_once_is_retried_and_the_run_finishes(tmp_path, model_cache):
    user = tmp_path / "user"
    user.mkdir()
    (user / "flaky_backend.py").write_text(textwrap.dedent(FLAKY_BACKEND))
    proc, run_dir = start_run(str(tmp_path / "runs"), model_cache, [
        "imports=[flaky_backend,arl.agents.sim_agent,arl.envs.sim_tool]", "agent.name=sim-agent",
        "env.name=sim-tool", "agent.args.prompt_tokens=16", "agent.args.max_new_tokens=16",
        "agent.args.max_total_tokens=200", "env.args.time_scale=0.001", "inference.backend=flaky-sim",
        "inference.sim.time_scale=0.001", "learner.backend=sim", "learner.sim.time_scale=0.001",
        "inference.num_workers=1", "total_train_steps=3"], cwd=str(user))
    code, _, err = finish(proc, timeout=600)
    assert code == 0, err[-6000:]
    s = summary(run_dir)
    assert s["finished"] and train_steps(run_dir) == [1, 2, 3]
    failed = [f for f in s["faults"] if f["kind"] == "weight_load_failed"]
    assert len(failed) == 1 and failed[0]["error"].startswith("OSError: flaky read of v") and failed[0]["server"] == 0
    assert_accounting(s)
    assert_no_leftovers(run_dir)
