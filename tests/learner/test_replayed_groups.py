"""The learner refuses a group id it has received before (a replayed `traj` frame, or a sender's bug), also after a
restart from a checkpoint: it is counted (`replayed_groups`), never buffered or trained, and returns no budget
(the controller never admitted it twice)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from arl.api.types import Trajectory
from arl.learner.worker import LearnerWorker
from arl.utils.idset import CounterIdSet

from ..typed_control import typed


def group(gid: str) -> list[Trajectory]:
    return [Trajectory(input_ids=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -1.0, -1.0],
                       versions=[-1, -1, 0, 0], reward=float(j), group_id=f"{gid}:{j}") for j in range(2)]


class FakePull:
    """Hands out `frames`, then waits forever (as a socket with nothing to read)."""

    def __init__(self, frames: list[tuple[str, Any]]) -> None:
        self.frames = list(frames)

    async def recv(self) -> tuple[str, Any]:
        if self.frames:
            return self.frames.pop(0)
        await asyncio.Event().wait()
        raise AssertionError


def learner(tmp_path, frames: list) -> tuple[LearnerWorker, list]:
    sent: list = []

    async def send(t: str, p: dict) -> None:
        sent.append((t, p))

    engine = SimpleNamespace(version=0)
    w = LearnerWorker(actor=SimpleNamespace(engine=engine), pull=FakePull(frames), send_control=typed(send), batch_size=2,
                      total_steps=1, weights_dir=str(tmp_path / "weights"))
    return w, sent


async def drain(w: LearnerWorker) -> None:
    task = asyncio.create_task(w.receive())
    for _ in range(50):
        await asyncio.sleep(0)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.mark.asyncio
async def test_a_replayed_group_is_refused_and_counted_also_after_a_restart(tmp_path):
    a = group("w0.t1g0")
    w, sent = learner(tmp_path, [("traj", a), ("traj", group("w0.t1g0")), ("traj", group("w0.t1g1")),
                                 ("traj", a)])
    await drain(w)
    assert [g[0].group_id for g in w.buffer] == ["w0.t1g0:0", "w0.t1g1:0"]
    assert w.stats["replayed_groups"] == 2 and w.stats["groups_received"] == 2
    # receipts for the two groups buffered; nothing for the replays (no budget returned for what was never admitted)
    assert sent == [("group_received", {"group_id": "w0.t1g0", "n_traj": 2}),
                    ("group_received", {"group_id": "w0.t1g1", "n_traj": 2})]
    state = w.checkpoint_state()
    assert set(CounterIdSet.from_state(state["received_group_ids"])) == {"w0.t1g0", "w0.t1g1"}
    # a restarted learner (from the checkpoint) refuses them too; a new group still gets in
    w2, sent2 = learner(tmp_path, [("traj", group("w0.t1g1")), ("traj", group("w0.t2g0"))])
    w2.restore(state)
    await drain(w2)
    assert [g[0].group_id for g in w2.buffer] == ["w0.t2g0:0"]
    assert w2.stats["replayed_groups"] == 1 + 2  # the counters came back with the checkpoint
    assert sent2 == [("group_received", {"group_id": "w0.t2g0", "n_traj": 2})]
