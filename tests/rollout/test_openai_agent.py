"""Agent functions written against the OpenAI SDK, run by EndpointAgent through the rollout worker's queue path
(`run_agent`): one session per trajectory, rewards from the return value or the env, every trajectory through the
token ledger, and a group that raises, hangs or calls after its session ended is dropped."""

from __future__ import annotations

import asyncio
import json
import os
import sys

import numpy as np
import openai
import pytest
import pytest_asyncio

from arl.api import GenerateRequest, GenerateResponse, GenerationConfig, SampleOutput
from arl.envs.math import MathEnv
from arl.models.tiny import TOOL_CHARS, build_char_tokenizer
from arl.rollout.endpoint import EndpointServer
from arl.rollout.ledger import EngineLog, verify_trajectory
from arl.rollout.openai_agent import EndpointAgent, SessionCallAfterEnd, is_endpoint_agent
from arl.rollout.worker import run_agent

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]

TOK = build_char_tokenizer(TOOL_CHARS)
EOS = TOK.eos_token_id
PROMPT = {"id": "12+7", "prompt": "12+7=", "answer": "19"}


class Client:
    """The inference client: answers "18" to a first turn and "19" after it (versions 3)."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest, info=None) -> GenerateResponse:
        self.requests.append(req)
        await asyncio.sleep(0)
        text = "19" if TOK.decode(req.input_ids.tolist()).count("<|user|>") > 1 else "18"
        ids = list(TOK.encode(text, add_special_tokens=False)) + [EOS]
        s = SampleOutput(ids, np.full(len(ids), -0.5, np.float32), [3] * len(ids), "stop")
        return GenerateResponse(qid=req.qid, samples=[s] * req.gconfig.n)


@pytest_asyncio.fixture
async def server():
    s = EndpointServer(TOK, GenerationConfig(max_new_tokens=8, stop_token_ids=[EOS]), max_context_len=256)
    yield s
    await s.close()


async def math_agent(client: openai.AsyncOpenAI, prompt: dict, env, num_turns: int = 3) -> dict:
    messages = [{"role": "user", "content": prompt["prompt"]}]
    for turn in range(num_turns):
        r = await client.chat.completions.create(model="policy", messages=messages)
        answer = r.choices[0].message.content
        if answer.strip() == prompt["answer"]:
            return {"reward": 0.9 ** turn, "solved": True, "first_correct": turn == 0}
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Wrong, try again."}]
    return {"reward": 0.0, "solved": False, "first_correct": False}


async def run(agent, client=None, timeout=20.0):
    client, log = client or Client(), EngineLog()
    trajs = await run_agent(agent, dict(PROMPT), MathEnv(), client, timeout, engine_log=log)
    return trajs, log, client


async def test_a_multi_turn_sdk_agent_makes_one_ledger_exact_trajectory_per_session(server):
    assert is_endpoint_agent(math_agent)
    trajs, log, client = await run(EndpointAgent(math_agent, server, group_size=3, args={"num_turns": 3}))
    assert len(trajs) == 3 and len(client.requests) == 6
    assert len({t.group_id for t in trajs}) == 1 and len({t.metadata["session"] for t in trajs}) == 3
    for t in trajs:
        verify_trajectory(t, log)
        assert t.reward == pytest.approx(0.9) and t.metadata["turns"] == 2 and t.metadata["solved"]
        assert t.metadata["first_correct"] is False and t.metadata["prompt_id"] == "12+7"
        assert t.num_generated == 6 and set(t.versions[t.loss_mask.astype(bool)].tolist()) == {3}
    assert server.sessions == {}  # every session ended with its group


async def test_none_takes_the_reward_from_the_env_and_base_url_agents_build_their_own_client(server):
    async def agent(base_url: str, api_key: str, prompt: dict) -> None:
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as c:
            await c.chat.completions.create(model="x", messages=[{"role": "user", "content": prompt["prompt"]}])

    trajs, log, _ = await run(EndpointAgent(agent, server, group_size=2))
    assert [t.reward for t in trajs] == [0.0, 0.0]  # "18" is wrong: MathEnv's reward
    for t in trajs:
        verify_trajectory(t, log)


async def test_an_agent_that_raises_fails_its_group(server):
    async def agent(client, prompt):
        await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "q"}])
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await run(EndpointAgent(agent, server, group_size=2))
    assert server.sessions == {}


async def test_a_call_after_the_session_ended_drops_the_group(server):
    leaked: list[asyncio.Task] = []

    async def agent(client, prompt):
        if not leaked:  # session 0 leaves a task behind that calls after the function returned
            async def late():
                await asyncio.sleep(0.05)
                await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "late"}])
            leaked.append(asyncio.create_task(late()))
            return 1.0
        await asyncio.sleep(1.0)
        await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "q"}])
        return 1.0

    with pytest.raises(SessionCallAfterEnd):
        await run(EndpointAgent(agent, server, group_size=2))
    with pytest.raises(openai.NotFoundError):
        await leaked[0]
    assert server.stats["late_calls"] == 1


async def test_an_agent_that_hangs_is_cut_at_the_trajectory_deadline(server):
    async def agent(client, prompt):
        await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "q"}])
        await asyncio.sleep(60)

    with pytest.raises(asyncio.TimeoutError):
        await run(EndpointAgent(agent, server, group_size=2), timeout=0.5)
    for _ in range(200):  # the abandoned agent's cancellation ends its sessions within a few loop iterations
        if not server.sessions:
            break
        await asyncio.sleep(0.01)
    assert server.sessions == {}


async def test_greedy_sessions_override_the_requests_sampling(server):
    async def agent(client, prompt):
        await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "q"}], temperature=0.7)
        return 0.0

    _, _, client = await run(EndpointAgent(agent, server, group_size=1, greedy=True))
    assert client.requests[0].gconfig.greedy


async def test_agent_args_must_be_parameters_of_the_function(server):
    with pytest.raises(TypeError, match="num_turns"):
        EndpointAgent(lambda_agent, server, args={"num_turns": 2})


async def lambda_agent(client, prompt):
    return 0.0


async def test_the_session_clients_log_no_line_per_call_and_wait_long_enough_to_connect(server, caplog):
    """The SDK's HTTP client logged every request at INFO (a line per turn in the worker's log), and its 5 s
    connect timeout dropped groups on a loaded worker (error:APITimeoutError in a run)."""
    caplog.set_level("INFO")
    trajs, _, _ = await run(EndpointAgent(math_agent, server, group_size=2))
    assert len(trajs) == 2
    assert not [r for r in caplog.records if r.name.startswith("httpx") or r.name.startswith("httpcore")]
    timeout = server.openai_client().timeout
    assert getattr(timeout, "connect", timeout) >= 60


class ToolClient:
    """The inference client of a tool-calling model: a hermes calculator call first, then the observed number."""

    def __init__(self, call: str) -> None:
        self.call, self.requests = call, []

    async def generate(self, req: GenerateRequest, info=None) -> GenerateResponse:
        self.requests.append(req)
        text = TOK.decode(req.input_ids.tolist())
        out = self.call if "<tool_response>" not in text else text.split("<tool_response>")[-1].split("<")[0]
        ids = list(TOK.encode(out, add_special_tokens=False)) + [EOS]
        s = SampleOutput(ids, np.full(len(ids), -0.5, np.float32), [3] * len(ids), "stop")
        return GenerateResponse(qid=req.qid, samples=[s])


@pytest.mark.parametrize("example", ["openai_tool_calc", "openai_framework"])
async def test_the_tool_examples_run_a_tool_loop_token_exactly(server, example):
    """experiments/openai_tool_calc.py (the SDK, tool loop in user code) and openai_framework.py (the OpenAI
    Agents SDK) against a model that calls the calculator: one trajectory per session, a tool call, reward 1."""
    if example == "openai_framework":
        pytest.importorskip("agents")
    import importlib

    fn = getattr(importlib.import_module(f"experiments.{example}"), example.replace("openai_", "") + "_agent")
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "12+7"}}</tool_call>'
    client, log = ToolClient(call), EngineLog()
    trajs = await run_agent(EndpointAgent(fn, server, group_size=2), dict(PROMPT), MathEnv(), client, 30.0,
                            engine_log=log)
    assert len(trajs) == 2 and len(client.requests) == 4
    for t in trajs:
        verify_trajectory(t, log)
        assert t.reward == 1.0 and t.metadata["tool_calls"] == 1 and t.metadata["turns"] == 2
        assert t.metadata["endpoint_prefix_mismatch"] == 0


async def test_the_agent_never_sees_the_run_secret(monkeypatch):
    """Built as a rollout worker builds it (`_endpoint_parts`, the role's secret in SOCKET_OPTIONS and ARL_SECRET in
    its environment): what the agent gets (api_key, base_url, the client's headers) and the environment of a
    subprocess it starts hold a per-session token, never the secret; and the secret opens no session."""
    from arl.config import ExperimentConfig
    from arl.rollout.entry import _endpoint_parts
    from arl.transport.control import SOCKET_OPTIONS

    secret = "run-secret-" + os.urandom(8).hex()
    monkeypatch.setitem(SOCKET_OPTIONS, "secret", secret.encode())
    monkeypatch.setenv("ARL_SECRET", secret)
    seen: list[dict] = []

    async def agent(client, base_url: str, api_key: str, prompt: dict) -> float:
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", "import json, os; print(json.dumps("
                                                    "dict(os.environ)))", env=env, stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        seen.append({"api_key": api_key, "base_url": base_url, "auth": dict(client.auth_headers),
                     "headers": {k: str(v) for k, v in client.default_headers.items()}, "child_env": json.loads(out)})
        r = await client.chat.completions.create(model="x", messages=[{"role": "user", "content": "12+7="}])
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as own:
            await own.chat.completions.create(model="x", messages=[{"role": "user", "content": "12+7="},
                                                                   r.choices[0].message.model_dump(exclude_none=True),
                                                                   {"role": "user", "content": "again"}])
        return 1.0

    parts = _endpoint_parts(ExperimentConfig(), agent, TOK, GenerationConfig(max_new_tokens=8, stop_token_ids=[EOS]),
                            2, [dict(PROMPT)], [])
    server, received = parts.endpoint, []
    opened = server._session

    def recording(in_path, headers):  # every request's headers, as the endpoint received them
        received.append(dict(headers))
        return opened(in_path, headers)

    server._session = recording
    try:
        trajs, log, client = await run(parts.make_agent())
        assert len(received) == 4 and all(secret not in json.dumps(h) for h in received)
        h = server.open_session(Client().generate)
        async with openai.AsyncOpenAI(base_url=server.session_url(h), api_key=secret, max_retries=0) as forged:
            with pytest.raises(openai.AuthenticationError):  # and the secret opens no session
                await forged.chat.completions.create(model="x", messages=[{"role": "user", "content": "q"}])
    finally:
        await server.close()
    assert len(trajs) == 2 and len(client.requests) == 4 and len(seen) == 2
    assert seen[0]["api_key"] != seen[1]["api_key"]
    for s in seen:
        assert secret not in json.dumps(s), [k for k, v in s["child_env"].items() if secret in v]
        assert s["child_env"]["OPENAI_API_KEY"] == s["api_key"] and s["auth"]["Authorization"].endswith(s["api_key"])
    assert server.stats["refused_auth"] == 1
