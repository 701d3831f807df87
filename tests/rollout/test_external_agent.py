"""The task API and `agent.name=external`: episodes handed to agents outside the run over HTTP, their sessions in
any dialect, rewards given back (a number, a dict, or the env's), and the bad input of the issue: unknown
episodes 404, ended or never handed out 409, a non-finite reward 400, a wrong key 401; an agent that vanishes
is timed out by the deadline and its group dropped."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
import pytest_asyncio

from arl.api import GenerationConfig
from arl.envs.math import MathEnv
from arl.rollout.endpoint import EndpointServer
from arl.rollout.external_agent import ExternalAgent
from arl.rollout.ledger import EngineLog, verify_trajectory
from arl.rollout.worker import run_agent
from tests.rollout.test_openai_agent import EOS, PROMPT, TOK, Client

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
KEY = "task-key-for-tests"


@pytest_asyncio.fixture
async def server():
    s = EndpointServer(TOK, GenerationConfig(max_new_tokens=8, stop_token_ids=[EOS]), max_context_len=256,
                       task_key=KEY)
    await s.start()
    yield s
    await s.close()


async def call(http, server, path="", body=None, key=KEY):
    async with http.post(server.url + "/rl/v1/episodes" + path, json=body or {},
                         headers={"Authorization": f"Bearer {key}"}) as r:
        return r.status, (await r.json() if r.status != 204 else None)


async def outside_agent(server, rewards):
    """What an agent in another process does: take an episode, answer through its session (the OpenAI SDK on its
    base URL and key, retrying once as the math agent does), give the reward back."""
    async with aiohttp.ClientSession() as http:
        for reward in rewards:
            status, ep = await call(http, server, body={"wait_s": 5})
            assert status == 200, ep
            async with openai.AsyncOpenAI(base_url=ep["base_url"], api_key=ep["api_key"], max_retries=0) as c:
                messages = [{"role": "user", "content": ep["prompt"]["prompt"]}]
                r = await c.chat.completions.create(model=ep["model"], messages=messages)
                messages += [r.choices[0].message.model_dump(exclude_none=True),
                             {"role": "user", "content": "Wrong, try again."}]
                await c.chat.completions.create(model=ep["model"], messages=messages)
            status, _ = await call(http, server, f"/{ep['episode_id']}/reward", {"reward": reward})
            assert status == 200


async def test_episodes_become_one_ledger_exact_group(server):
    agent, log = ExternalAgent(server, group_size=3, deadline_s=30), EngineLog()
    group = asyncio.create_task(run_agent(agent, dict(PROMPT), MathEnv(), Client(), 30.0, engine_log=log))
    await outside_agent(server, [1.0, {"reward": 0.5, "solved": True}, None])  # None: the env scores "19"
    trajs = await group
    assert sorted(t.reward for t in trajs) == [0.5, 1.0, 1.0] and len({t.group_id for t in trajs}) == 1
    for t in trajs:
        verify_trajectory(t, log)
        assert t.metadata["turns"] == 2 and t.metadata["prompt_id"] == PROMPT["id"]
    assert server.board.stats["rewarded"] == 3 and not server.board.episodes


async def test_bad_input_is_refused_by_name(server):
    agent = ExternalAgent(server, group_size=1, deadline_s=30)
    group = asyncio.create_task(run_agent(agent, dict(PROMPT), MathEnv(), Client(), 30.0))
    async with aiohttp.ClientSession() as http:
        assert (await call(http, server, key="wrong"))[0] == 401
        assert (await call(http, server, "/ep_nope/reward", {"reward": 1.0}))[0] == 404
        while not server.board.episodes:
            await asyncio.sleep(0.01)
        (ep_id,) = server.board.episodes
        status, err = await call(http, server, f"/{ep_id}/reward", {"reward": 1.0})
        assert status == 409 and err["error"]["code"] == "episode_not_taken"
        status, ep = await call(http, server, body={"wait_s": 1})
        assert status == 200 and ep["episode_id"] == ep_id and ep["deadline_s"] > 0
        for bad in ({"reward": float("nan")}, {"reward": "1"}, {"reward": {"solved": True}}, {"score": 1}):
            status, err = await call(http, server, f"/{ep_id}/reward", bad)
            assert status == 400, bad
        async with openai.AsyncOpenAI(base_url=ep["base_url"], api_key=ep["api_key"], max_retries=0) as c:
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "12+7="}])
        assert (await call(http, server, f"/{ep_id}/reward", {"reward": 1.0}))[0] == 200
        status, err = await call(http, server, f"/{ep_id}/reward", {"reward": 1.0})
        assert status == 409 and err["error"]["code"] == "episode_ended"
        assert (await call(http, server, body={"wait_s": 0}))[0] == 204  # nothing offered now
    assert len(await group) == 1


async def test_an_agent_that_vanishes_is_timed_out_and_its_episodes_leave_the_board(server):
    agent = ExternalAgent(server, group_size=2, deadline_s=1.0)
    group = asyncio.create_task(run_agent(agent, dict(PROMPT), MathEnv(), Client(), 1.0))
    async with aiohttp.ClientSession() as http:
        status, ep = await call(http, server, body={"wait_s": 2})  # takes one episode and never answers
        assert status == 200
        with pytest.raises(asyncio.TimeoutError):
            await group
        status, err = await call(http, server, f"/{ep['episode_id']}/reward", {"reward": 1.0})
        assert status == 409 and "dropped" in err["error"]["message"]
    assert not server.board.episodes and server.board.open == 0
    assert server.board.stats["expired_claimed"] == 1 and server.board.stats["withdrawn_unclaimed"] == 1


async def test_the_task_api_is_off_without_a_key():
    s = EndpointServer(TOK, GenerationConfig(max_new_tokens=8, stop_token_ids=[EOS]), max_context_len=256)
    reply = await s.dispatch("POST", "/rl/v1/episodes", {"Authorization": "Bearer x"}, b"{}")
    assert reply.status == 404
