"""The synthetic benchmark workload: sim agent + sim tool env against the sim engine, in one process."""

import asyncio

import numpy as np
import pytest

from arl.agents.sim_agent import SimAgent
from arl.api.types import GenerateRequest, GenerationConfig
from arl.config import SimEngineConfig
from arl.envs.sim_tool import SimToolEnv
from arl.inference.sim_engine import SimEngine
from arl.rollout.worker import run_agent


class EngineClient:
    """Stands in for InferenceClient: calls the engine directly, recording requests."""

    def __init__(self, engine):
        self.engine = engine
        self.requests: list[GenerateRequest] = []

    async def generate(self, req):
        self.requests.append(req)
        return await self.engine.agenerate(req)


async def collect(engine_seed: int, **agent_kw):
    engine = SimEngine(SimEngineConfig(time_scale=1e-4, len_median=30, len_sigma=1.0, vocab_size=100,
                                       prefill_per_token_s=0.0), seed=engine_seed, workload_seed=7)
    client = EngineClient(engine)
    env = SimToolEnv(latency_median_s=0.01, time_scale=0.1, turns_min=1, turns_max=3, seed=3)
    agent = SimAgent(gconfig=GenerationConfig(), group_size=4, prompt_tokens=8, max_new_tokens=500,
                     max_total_tokens=4000, vocab_size=100, seed=5, **agent_kw)
    trajs = await run_agent(agent, {"id": "p1"}, env, client, timeout=30)
    await engine.close()
    return trajs, client, env


@pytest.mark.asyncio
async def test_multi_turn_group_with_tool_context_and_repeatable_workload():
    trajs, client, env = await collect(engine_seed=1)
    assert len(trajs) == 4 and {t.group_id for t in trajs} == {"p1"}
    for i, t in enumerate(trajs):
        turns = t.metadata["turns"]
        assert turns == env.turns(f"p1/{i}") and 1 <= turns <= 3
        assert t.metadata["termination"] == "done" and t.reward in (0.0, 1.0)
        assert t.num_generated == t.metadata["generated"] > 0
        assert (t.loss_mask[:8] == 0).all() and (t.versions[t.loss_mask == 1] == 0).all()
        # one mask-0 tool block between consecutive turns
        edges = np.flatnonzero(np.diff(t.loss_mask.astype(int)) != 0)
        assert len(edges) == 2 * turns - 1
    sessions = {r.session_id for r in client.requests}
    assert sessions == {f"p1/{i}" for i in range(4)}
    again, _, _ = await collect(engine_seed=99)  # another engine seed: the keyed workload is the same
    for a, b in zip(trajs, again):
        np.testing.assert_array_equal(a.input_ids, b.input_ids)


@pytest.mark.asyncio
async def test_agent_length_mode_asks_for_exact_lengths():
    trajs, client, _ = await collect(engine_seed=1, length_mode="agent", len_median=20.0, len_sigma=0.5)
    for r in client.requests:
        assert r.gconfig.min_new_tokens == r.gconfig.max_new_tokens >= 1
    lengths = [r.gconfig.max_new_tokens for r in client.requests]
    assert sum(len(t.input_ids) for t in trajs) > 0 and len(set(lengths)) > 1


@pytest.mark.asyncio
async def test_env_rejects_bad_actions_without_raising():
    env = SimToolEnv(latency_median_s=0.0)
    obs, reward, terminated, truncated, info = await env.step("not a dict")
    assert reward == 0.0 and terminated and "error" in info
    obs, reward, terminated, _, _ = await env.step({"session": "s", "turn": 0, "n_tokens": 3})
    assert isinstance(obs, int)
    with pytest.raises(ValueError):
        SimToolEnv(turns_min=3, turns_max=1)
    with pytest.raises(ValueError):
        SimAgent(length_mode="bogus")
