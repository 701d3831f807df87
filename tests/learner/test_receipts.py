"""The learner's receipts: every group it buffers is reported to the controller by id (which settles the group
even if its rollout worker dies before group_done), and a group it refuses on arrival is dropped by id."""

from __future__ import annotations

import asyncio
import tempfile

import pytest

from arl.api.staleness import StalenessPolicy
from arl.config import PPOConfig, SimLearnerConfig
from arl.learner.actor import PPOActor
from arl.learner.sim_learner import SimLearner
from arl.learner.worker import LearnerWorker

from ..typed_control import typed
from .test_stale_groups import traj


class ListPull:
    def __init__(self, groups: list) -> None:
        self._groups = list(groups)

    async def recv(self):
        if not self._groups:
            await asyncio.sleep(3600)
        return "traj", self._groups.pop(0)


@pytest.mark.asyncio
async def test_received_groups_are_reported_by_id_and_refused_ones_dropped_by_id():
    good = [traj("w0.aag0", 0, [5]), traj("w0.aag0", 1, [5])]
    bad = [traj("w0.aag1", 0, [5])]
    bad[0].input_ids[0] = 10_000  # outside the vocabulary
    sent: list = []

    async def send(msg_type: str, payload: dict) -> None:
        sent.append((msg_type, payload))

    actor = PPOActor(SimLearner(SimLearnerConfig(s_per_token=0.0, step_base_s=0.0), version=5), PPOConfig(), staleness=StalenessPolicy(2))
    worker = LearnerWorker(actor=actor, pull=ListPull([good, bad]), send_control=typed(send), batch_size=2, total_steps=9,
                           weights_dir=tempfile.mkdtemp(), vocab_size=100)
    task = asyncio.create_task(worker.receive())
    for _ in range(200):
        if len(sent) == 2:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert sent == [("group_received", {"group_id": "w0.aag0", "n_traj": 2}),
                    ("groups_dropped", {"n": 1, "reason": "invalid", "group_ids": ["w0.aag1"]})]
