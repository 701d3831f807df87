"""run_agent's queue pair: the direct path (`obs_queue.generate`, used by arl.agents.common.generate) and the
plain queue protocol (put on obs_queue, get from act_queue) give the same answers, and both feed the engine log."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from arl.agents.common import generate
from arl.api import Agent, GenerateRequest, GenerationConfig, GenerateResponse, SampleOutput, Trajectory
from arl.rollout.ledger import EngineLog
from arl.rollout.worker import run_agent

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(30)]


class EchoClient:
    """Answers with the prompt reversed; counts requests."""

    def __init__(self) -> None:
        self.requests: list[GenerateRequest] = []

    async def generate(self, req: GenerateRequest) -> GenerateResponse:
        self.requests.append(req)
        await asyncio.sleep(0)
        ids = np.asarray(req.input_ids, np.int32)[::-1].copy()
        s = SampleOutput(ids, np.full(len(ids), -0.5, np.float32), np.zeros(len(ids), np.int32), "stop")
        return GenerateResponse(qid=req.qid, samples=[s])


def _traj(resp: GenerateResponse) -> Trajectory:
    ids = resp.samples[0].output_ids
    n = len(ids)
    return Trajectory(ids, np.ones(n, np.int8), np.zeros(n, np.float32), np.zeros(n, np.int32), 1.0, "g")


class DirectAgent(Agent):
    """Uses the helper, which takes the obs queue's direct path: the act queue must stay untouched."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        assert hasattr(obs_queue, "generate")
        resps = await asyncio.gather(*(generate(obs_queue, act_queue, GenerateRequest(f"q{i}", [1, 2, i + 3]))
                                       for i in range(3)))
        assert act_queue.empty()
        return [_traj(r) for r in resps]


class QueueAgent(Agent):
    """Talks the plain queue protocol (AReaL style), including a malformed request."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        await obs_queue.put(("t0", [4, 5, 6], GenerationConfig(max_new_tokens=3)))
        obs_queue.put_nowait(GenerateRequest("r1", [7, 8]))
        await obs_queue.put(("bad", [1], "not a config"))
        got = {}
        for _ in range(3):
            resp = await asyncio.wait_for(act_queue.get(), 5)
            got[resp.qid] = resp
        assert got["bad"].error is not None and "bad request" in got["bad"].error
        return [_traj(got["t0"]), _traj(got["r1"])]


async def test_direct_path_answers_without_the_act_queue_and_logs():
    client, log = EchoClient(), EngineLog()
    trajs = await run_agent(DirectAgent(), {"id": "p"}, None, client, timeout=10, engine_log=log)  # type: ignore[arg-type]
    assert [t.input_ids.tolist() for t in trajs] == [[3, 2, 1], [4, 2, 1], [5, 2, 1]]
    assert len(client.requests) == 3 and log.n_samples == 3
    assert log.candidates(np.array([4, 2, 1]))


async def test_queue_protocol_still_works_and_refuses_bad_requests():
    client, log = EchoClient(), EngineLog()
    trajs = await run_agent(QueueAgent(), {"id": "p"}, None, client, timeout=10, engine_log=log)  # type: ignore[arg-type]
    assert [t.input_ids.tolist() for t in trajs] == [[6, 5, 4], [8, 7]]
    assert len(client.requests) == 2 and log.n_samples == 2  # the bad one never reached the client


async def test_requests_left_in_flight_are_cancelled_when_the_agent_returns():
    started, cancelled = asyncio.Event(), asyncio.Event()

    class SlowClient:
        async def generate(self, req):
            started.set()
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    class FireAndForget(Agent):
        async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
            obs_queue.put_nowait(GenerateRequest("x", [1]))
            await started.wait()
            return []

    assert await run_agent(FireAndForget(), {}, None, SlowClient(), timeout=10) == []  # type: ignore[arg-type]
    await asyncio.wait_for(cancelled.wait(), 5)
