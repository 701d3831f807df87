"""Every admitted group ends with exactly one group_done, whatever fails after the agent returned: what an agent
may put in a trajectory is made sendable, a group that still cannot be sent is dropped with a reason (an
over-size one as `too_large`, with its size), and a group_done that cannot go as it is goes without its extras."""

from __future__ import annotations

import numpy as np
import pytest

from arl.api import TrajectoryBuilder
from arl.transport.codec import decode, encode
from arl.transport.sockets import FrameTooLarge, Push

from ..typed_control import typed
from .test_guards import OneShotAgent, make_worker, run_groups


class MetadataAgent(OneShotAgent):
    """Trajectories as a careless agent leaves them: a turn reward appended as the env's per-answer list, numpy
    scalars and arrays in the metadata."""

    async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
        trajs = await super().collect_trajectory(prompt, env, obs_queue, act_queue)
        for i, t in enumerate(trajs):
            t.turn_rewards.append([1.0])  # what a stateless env's step returns for one answer
            t.turn_rewards.append(np.float32(0.5))
            t.metadata.update(score=np.float32(0.25), hits=np.arange(3), turns=np.int64(2), ok=np.bool_(i == 0),
                              nested={"pair": (np.int32(1), np.float64(2.0))})
        return trajs


def wire_push(pushed):
    async def push(group):  # the real encoder, as the PUSH socket runs it
        pushed.append(decode(encode("traj", group))[1])
    return push


@pytest.mark.asyncio
async def test_turn_rewards_and_numpy_metadata_reach_the_learner():
    sent, pushed = [], []
    worker = make_worker([{"id": "p", "mode": "ok"}], sent, [], agent_factory=MetadataAgent)
    worker._push = wire_push(pushed)
    await run_groups(worker, 2)
    done = [p for t, p in sent if t == "group_done"]
    assert [p["reason"] for p in done] == ["accepted", "accepted"]
    (t0, t1), _ = pushed
    assert t0.turn_rewards == [1.0, 0.5] and t0.metadata["hits"] == [0, 1, 2] and t0.metadata["ok"] is True
    assert t0.metadata["score"] == 0.25 and t0.metadata["nested"] == {"pair": [1, 2.0]}
    assert done[0]["traj_stats"]["turns"] == 4  # numpy ints count in the trajectory means too


def test_a_trajectory_takes_turn_rewards_as_it_takes_its_reward():
    b = TrajectoryBuilder([1, 2])
    t = b.build(reward=np.array([1.0]), group_id="g", turn_rewards=[[0.0], np.float64(1.0), np.array([1])])
    assert t.reward == 1.0 and t.turn_rewards == [0.0, 1.0, 1.0] and all(type(r) is float for r in t.turn_rewards)
    with pytest.raises(ValueError, match="turn_rewards"):
        b.build(reward=1.0, group_id="g", turn_rewards=[[0.0, 1.0]])


@pytest.mark.asyncio
async def test_unsendable_and_oversize_groups_are_dropped_with_a_reason():
    class SetAgent(OneShotAgent):
        async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
            trajs = await super().collect_trajectory(prompt, env, obs_queue, act_queue)
            trajs[0].metadata["tags"] = {"a"}  # a set: the wire cannot carry it
            return trajs

    sent = []
    worker = make_worker([{"id": "p", "mode": "ok"}], sent, [], agent_factory=SetAgent)
    worker._push = wire_push([])
    await run_groups(worker, 1)
    (p,) = [p for t, p in sent if t == "group_done"]
    assert p["reason"] == "error:TypeError" and not p["accepted"]

    push = Push(max_bytes=600)  # the socket refuses the frame before anything is sent
    try:
        sent = []
        worker = make_worker([{"id": "p", "mode": "ok"}], sent, [])
        worker._push = lambda group: push.send("traj", group)
        await run_groups(worker, 2)
    finally:
        push.close()
    done = [p for t, p in sent if t == "group_done"]
    assert [p["reason"] for p in done] == ["too_large", "too_large"] and not any(p["accepted"] for p in done)
    assert all(p["size_bytes"] > 600 for p in done) and worker.drop_reasons == {"too_large": 2}


@pytest.mark.asyncio
async def test_a_group_done_that_cannot_go_as_it_is_goes_without_its_extras():
    sent = []

    async def send(msg_type, payload):
        if msg_type == "group_done" and "traj_stats" in payload:
            raise FrameTooLarge(msg_type, 10**9, 64 << 20)  # say, traces of huge trajectories
        sent.append((msg_type, payload))

    worker = make_worker([{"id": "p", "mode": "ok"}], [], [])
    worker._send = typed(send)
    await run_groups(worker, 1)
    (p,) = [p for t, p in sent if t == "group_done"]
    assert p["accepted"] and p["reason"] == "accepted" and p["group_id"].startswith("w0.")
    assert worker.stats["group_done_trimmed"] == 1


@pytest.mark.asyncio
async def test_a_reward_spoiled_after_the_build_drops_only_its_group():
    class SpoilAgent(OneShotAgent):
        async def collect_trajectory(self, prompt, env, obs_queue, act_queue):
            trajs = await super().collect_trajectory(prompt, env, obs_queue, act_queue)
            trajs[0].reward = "1.0?"  # set after the Trajectory checked it
            return trajs

    sent = []
    worker = make_worker([{"id": "p", "mode": "ok"}], sent, [], agent_factory=SpoilAgent)
    await run_groups(worker, 1)
    (p,) = [p for t, p in sent if t == "group_done"]
    assert p["reason"] == "error:ValueError" and not p["accepted"]
