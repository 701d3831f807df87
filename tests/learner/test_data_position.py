"""The learner books each prompt position once it settles (trained, dropped as stale or invalid here, or dropped
by a rule at its rollout worker, told by a `prompt_settled` notice), keeps that exact data position in its
checkpoint, and drops a group whose prompt had settled or is buffered already (`duplicate_prompt`)."""

from __future__ import annotations

import json

import pytest

from arl.api.staleness import StalenessPolicy
from arl.data.position import DataPosition
from arl.transport.messages import PromptSettled

from .test_replayed_groups import drain, group, learner


def at(gid: str, worker: int, pos: int, version: int = 0) -> list:
    g = group(gid)
    for t in g:
        t.metadata["prompt_pos"] = [worker, pos]
        t.versions[t.loss_mask.astype(bool)] = version
    return g


def notice(worker: int, pos: int, reason: str = "filtered") -> tuple:
    msg = PromptSettled(worker=worker, position=pos, reason=reason)
    return msg.TYPE, msg.to_payload()


@pytest.mark.asyncio
async def test_positions_settle_when_consumed_dropped_here_or_told_and_the_checkpoint_keeps_them(tmp_path):
    frames = [("traj", at("w0.ag0", 0, 0)), ("traj", at("w0.ag1", 0, 2)), notice(0, 1), notice(1, 0, "timeout"),
              ("traj", at("w1.bg0", 1, 1)), ("traj", at("w0.ag2", 0, 5)), ("prompt_settled", {"worker": "x"})]
    w, sent = learner(tmp_path, frames)
    await drain(w)
    assert w.stats["prompts_settled_by_rollout"] == 2 and len(w.buffer) == 4
    assert w.data_position == {"0": DataPosition(0, [1]), "1": DataPosition(1)}  # told, nothing trained yet
    batch = await w.next_batch()  # B = 2: the first two buffered groups are consumed
    assert len(batch) == 4
    assert w.data_position["0"] == DataPosition(3)  # 0, 1, 2 dense
    state = json.loads(json.dumps(w.checkpoint_state()))
    assert state["data_position"] == {"0": {"low": 3, "above": []}, "1": {"low": 1, "above": []}}
    # buffered at the checkpoint (w1 pos 1, w0 pos 5): not settled, a resume draws them again
    w2, _ = learner(tmp_path, [])
    w2.restore(state)
    assert 1 not in w2.data_position["1"] and 5 not in w2.data_position["0"]


@pytest.mark.asyncio
async def test_a_group_of_a_settled_or_buffered_prompt_is_received_then_dropped_as_duplicate(tmp_path):
    frames = [("traj", at("w0.ag0", 0, 0)), ("traj", at("w0.bg0", 0, 0)),  # a restarted worker's re-draw
              notice(0, 3), ("traj", at("w0.bg1", 0, 3)), ("traj", at("w0.bg2", 0, 4))]
    w, sent = learner(tmp_path, frames)
    await drain(w)
    assert [g[0].group_id for g in w.buffer] == ["w0.ag0:0", "w0.bg2:0"] and w.stats["duplicate_prompts"] == 2
    # received (the controller's accepted count stays whole), then dropped like a stale group: budget back
    assert [(t, p.get("group_id"), p.get("reason")) for t, p in sent] == [
        ("group_received", "w0.ag0", None), ("group_received", "w0.bg0", None),
        ("groups_dropped", None, "duplicate_prompt"), ("group_received", "w0.bg1", None),
        ("groups_dropped", None, "duplicate_prompt"), ("group_received", "w0.bg2", None)]
    assert w.stats["groups_received"] == 4 and w.stats["duplicate_trajectories"] == 4


@pytest.mark.asyncio
async def test_stale_drops_settle_their_prompts(tmp_path):
    w, sent = learner(tmp_path, [("traj", at("w0.ag0", 0, 0, version=0)), ("traj", at("w0.ag1", 0, 1, 3)),
                                 ("traj", at("w0.ag2", 0, 2, 3))])
    w.staleness = StalenessPolicy(eta=1)
    w.engine.version = 3
    await drain(w)
    await w.next_batch()
    assert w.stats["stale_groups_dropped"] == 1 and w.data_position["0"] == DataPosition(3)
