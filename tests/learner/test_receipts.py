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


@pytest.mark.asyncio
async def test_a_listed_policys_learner_books_no_group_and_checks_only_its_own_tokens():
    """A trainable listed policy's learner (`books_groups=False`) gets every group: it buffers those with tokens
    of its policy (whose versions are its own: the run's policy's tokens may be newer than its version), drops
    the others with their budget back for its own bound, and never settles a group at the controller."""
    import dataclasses

    def rival(t, versions):  # the trajectory's generated tokens are the rival's, at `versions`
        t = dataclasses.replace(t, policy_spans=[("rival", 0, len(t.input_ids))])
        t.versions[2:2 + len(versions)] = versions
        return t

    own = [traj("w0.aag0", 0, [9]), traj("w0.aag0", 1, [9])]  # the run's policy at v9, ahead of the rival's v5
    mixed = [traj("w0.aag1", 0, [9]), rival(traj("w0.aag1", 1, [0]), [5])]
    too_new = [rival(traj("w0.aag2", 0, [0]), [6])]  # no rival token can be newer than the rival's learner
    sent: list = []

    async def send(msg_type: str, payload: dict) -> None:
        sent.append((msg_type, payload))

    actor = PPOActor(SimLearner(SimLearnerConfig(s_per_token=0.0, step_base_s=0.0), version=5), PPOConfig(),
                     staleness=StalenessPolicy(2), policy="rival")
    worker = LearnerWorker(actor=actor, pull=ListPull([own, mixed, too_new]), send_control=typed(send),
                           batch_size=2, total_steps=9, weights_dir=tempfile.mkdtemp(), vocab_size=100,
                           books_groups=False)
    task = asyncio.create_task(worker.receive())
    for _ in range(200):
        st = worker.stats
        if st["groups_received"] + st["groups_without_policy"] + st["invalid_groups"] == 3:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert [g[0].group_id for g in worker.buffer] == ["w0.aag1:0"]
    assert worker.stats["groups_without_policy"] == 1 and worker.stats["invalid_groups"] == 1
    assert sent == [("groups_dropped", {"n": 1, "reason": "no_policy_tokens"}),
                    ("groups_dropped", {"n": 1, "reason": "invalid", "group_ids": ["w0.aag2"]})]
