"""A group's queue pair, its QueueClient, timeline and engine log are freed when the group ends (audit item 1:
`_CLIENTS` once kept every group's client alive for the life of the rollout worker)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from arl.agents.common import QueueClient, generate, queue_client
from arl.api import Agent, GenerateRequest, GenerateResponse
from arl.report.traces import GroupTimeline
from arl.rollout.ledger import EngineLog
from arl.rollout.worker import run_agent
from tests.rollout.test_run_agent import EchoClient as RunAgentEcho, _traj

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]


class EchoClient(RunAgentEcho):
    """run_agent's echo client, taking the `info` a traced request passes."""

    async def generate(self, req: GenerateRequest, info: dict | None = None) -> GenerateResponse:
        return await super().generate(req)


class HelperAgent(Agent):
    """The built-in agents' way: `generate` (direct path) and `queue_client` (what EndpointAgent binds)."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        a = await generate(obs_queue, act_queue, GenerateRequest(f"{prompt['id']}-a", [1, 2, 3]))
        b = await queue_client(obs_queue, act_queue).generate(GenerateRequest(f"{prompt['id']}-b", [4, 5]))
        return [_traj(a), _traj(b)]


def _live(cls: type) -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, cls))


async def test_no_group_state_outlives_its_group():
    client = EchoClient()
    before = (_live(QueueClient), _live(GroupTimeline), _live(EngineLog))
    for i in range(50):
        trajs = await run_agent(HelperAgent(), {"id": f"p{i}"}, None, client, timeout=10,  # type: ignore[arg-type]
                                engine_log=EngineLog(), timeline=GroupTimeline())
        assert len(trajs) == 2
    del trajs
    await asyncio.sleep(0.01)  # idle readers stop one loop iteration after their last answer
    after = (_live(QueueClient), _live(GroupTimeline), _live(EngineLog))
    assert after == before, f"live (QueueClient, GroupTimeline, EngineLog): {before} -> {after} after 50 groups"


async def test_plain_queue_pairs_share_one_client_while_alive_and_free_it_after():
    obs: asyncio.Queue = asyncio.Queue()
    act: asyncio.Queue = asyncio.Queue()
    c = queue_client(obs, act)
    assert queue_client(obs, act) is c  # concurrent chains on one pair must share the reader
    base = _live(QueueClient)
    del c, obs, act
    assert _live(QueueClient) == base - 1


async def test_plain_queue_pair_round_trip_after_the_caller_drops_its_client():
    obs: asyncio.Queue = asyncio.Queue()
    act: asyncio.Queue = asyncio.Queue()

    async def server() -> None:
        for _ in range(2):
            req = await obs.get()
            resp = await EchoClient().generate(req)
            act.put_nowait(resp)

    srv = asyncio.ensure_future(server())
    r1, r2 = await asyncio.gather(generate(obs, act, GenerateRequest("x", [1, 2])),
                                  generate(obs, act, GenerateRequest("y", [3])))
    await srv
    assert r1.samples[0].output_ids.tolist() == [2, 1] and r2.samples[0].output_ids.tolist() == [3]
