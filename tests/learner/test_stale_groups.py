"""Staleness at consumption through the learner worker's loop (simulated engine, real PPO actor): which groups
the worker drops as stale and what the actor does with the old tokens of the groups it keeps, per
`learner.ppo.stale_tokens`."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from arl.api.staleness import StalenessPolicy
from arl.api.types import Trajectory
from arl.config import PPOConfig, SimLearnerConfig
from arl.learner.actor import PPOActor
from arl.learner.sim_learner import SimLearner
from arl.learner.worker import LearnerWorker

from ..typed_control import typed

V, ETA = 5, 2  # the learner is at version 5: tokens older than v3 are more than eta behind


def traj(gid: str, i: int, versions: list[int]) -> Trajectory:
    """Two prompt tokens, then one generated token per entry of `versions` (none: nothing was generated)."""
    n = 2 + max(1, len(versions))
    mask = np.zeros(n, np.int8)
    ver = np.zeros(n, np.int32)
    mask[2:2 + len(versions)] = 1
    ver[2:2 + len(versions)] = versions
    return Trajectory(input_ids=np.arange(n, dtype=np.int32), loss_mask=mask, logprobs=np.full(n, -1.0, np.float32),
                      versions=ver, reward=float(i), group_id=f"{gid}:{i}")


GROUPS = {
    "fresh": [traj("fresh", 0, [5, 5]), traj("fresh", 1, [4, 5])],
    "mixed": [traj("mixed", 0, [1, 1, 4]), traj("mixed", 1, [4, 5])],  # two tokens 4 versions behind
    "old": [traj("old", 0, [1, 2]), traj("old", 1, [2, 2])],  # every token more than eta behind
    "empty_answer": [traj("empty_answer", 0, [5]), traj("empty_answer", 1, [])],  # one answer generated nothing
}


async def one_step(mode: str, kept: int) -> tuple[LearnerWorker, list, list]:
    """Buffer every group, train one step of `kept` groups; returns the worker, the prepared batches and what
    it sent to the controller."""
    actor = PPOActor(SimLearner(SimLearnerConfig(s_per_token=0.0, step_base_s=0.0), version=V),
                     PPOConfig(), staleness=StalenessPolicy(ETA, mode))
    prepared: list = []
    prepare = actor.prepare
    actor.prepare = lambda trajs: prepared.append(prepare(trajs)) or prepared[-1]  # type: ignore[method-assign]
    sent: list = []

    async def send(msg_type: str, payload: dict) -> None:
        sent.append((msg_type, payload))

    import tempfile

    worker = LearnerWorker(actor=actor, pull=None, send_control=typed(send), batch_size=kept, total_steps=V + 1,
                           weights_dir=tempfile.mkdtemp(), staleness=actor.staleness)
    worker.buffer.extend(GROUPS.values())
    await asyncio.wait_for(worker.train(), 60)
    return worker, prepared, sent


def trained_groups(batch) -> list[str]:
    return sorted({t.group_id.split(":")[0] for t in batch.received})


@pytest.mark.asyncio
async def test_keep_drops_every_group_with_a_token_beyond_eta():
    worker, prepared, sent = await one_step("keep", kept=2)
    (batch,) = prepared
    assert trained_groups(batch) == ["empty_answer", "fresh"]  # an answer with no tokens is not "stale"
    assert ("groups_dropped", {"n": 2, "reason": "stale"}) in sent
    assert worker.stats["stale_groups_dropped"] == 2 and worker.stats["staleness_violations"] == 0
    for t in batch.data.trajs:  # the bound: no consumed token more than eta behind
        assert (t.versions[t.loss_mask.astype(bool)] >= V - ETA).all()


@pytest.mark.asyncio
async def test_drop_keeps_the_group_and_takes_its_old_tokens_out_of_the_loss():
    worker, prepared, sent = await one_step("drop", kept=3)
    (batch,) = prepared
    assert trained_groups(batch) == ["empty_answer", "fresh", "mixed"]
    assert ("groups_dropped", {"n": 1, "reason": "stale"}) in sent  # only the group with nothing within eta
    mixed = [t for t in batch.data.trajs if t.group_id.startswith("mixed")]
    assert mixed[0].loss_mask.tolist() == [0, 0, 0, 0, 1]  # the two v1 tokens left the loss, v4 stayed
    for t in batch.data.trajs:
        assert (t.versions[t.loss_mask.astype(bool)] >= V - ETA).all()
    assert worker.stats["staleness_violations"] == 0  # received head was 4 > eta, but nothing stale was consumed
    metrics = next(p["metrics"] for m, p in sent if m == "weights_published")
    assert metrics["head_offpolicyness"] == 4 and metrics["stale_token_frac"] > 0


@pytest.mark.asyncio
async def test_downweight_keeps_old_tokens_with_a_decayed_weight():
    worker, prepared, sent = await one_step("downweight", kept=3)
    (batch,) = prepared
    assert trained_groups(batch) == ["empty_answer", "fresh", "mixed"]
    i = next(k for k, t in enumerate(batch.data.trajs) if t.group_id == "mixed:0")
    assert batch.data.trajs[i].loss_mask.tolist() == [0, 0, 1, 1, 1]
    w = batch.data.fields["token_weights"][i]
    assert w[2:].tolist() == [0.25, 0.25, 1.0]  # 0.5 ** (lag 4 - eta 2)
    assert worker.stats["stale_groups_dropped"] == 1


@pytest.mark.asyncio
async def test_idle_seconds_count_the_time_spent_waiting_for_a_batch(tmp_path):
    """`idle_seconds` (heartbeats, the report's "learner idle" chart) adds up the learner's waits for groups."""

    class SlowPull:
        def __init__(self) -> None:
            self.groups = [GROUPS["fresh"]]

        async def recv(self):
            if not self.groups:
                await asyncio.sleep(3600)
            await asyncio.sleep(0.3)
            return "traj", self.groups.pop()

    async def send(msg_type: str, payload: dict) -> None:
        pass

    actor = PPOActor(SimLearner(SimLearnerConfig(s_per_token=0.0, step_base_s=0.0), version=V), PPOConfig(), staleness=StalenessPolicy(ETA))
    worker = LearnerWorker(actor=actor, pull=SlowPull(), send_control=typed(send), batch_size=1, total_steps=V + 1,
                           weights_dir=str(tmp_path), staleness=actor.staleness)
    receiver = asyncio.create_task(worker.receive())
    try:
        await asyncio.wait_for(worker.train(), 60)
    finally:
        receiver.cancel()
    assert worker.stats["idle_seconds"] >= 0.25
    assert worker.heartbeat_stats()["idle_seconds"] == worker.stats["idle_seconds"]
