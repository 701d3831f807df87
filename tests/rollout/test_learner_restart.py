"""A rollout worker while the learner is restarted: finished groups wait for the new learner (pushed to the old one
they would be lost), a group holding tokens of a version the restarted learner does not have is dropped as
`lost_version` (its budget returns with its group_done), groups started after the rollback are not checked, and
the prompt stream rewinds to the checkpoint's position, drawing a lost group's prompt again."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from arl.api.types import GenerateResponse, SampleOutput

from .test_guards import FakeClient, make_worker


class VersionedClient(FakeClient):
    """Answers once `release` is set, the k-th request's tokens stamped with `versions[k]`."""

    def __init__(self, versions: list[int]) -> None:
        super().__init__()
        self.versions, self.release = list(versions), asyncio.Event()

    async def generate(self, req):
        await self.release.wait()
        v = self.versions.pop(0)
        s = SampleOutput(np.array([5, 6, 7], np.int32), np.full(3, -0.5, np.float32), np.full(3, v, np.int32), "stop")
        return GenerateResponse(qid=req.qid, samples=[s] * req.gconfig.n)


async def settle(worker, until) -> None:
    for _ in range(300):
        if until():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


@pytest.mark.asyncio
async def test_groups_wait_for_the_restarted_learner_and_those_of_lost_versions_are_dropped():
    rows = [{"id": f"p{i}", "mode": "ok"} for i in range(6)]
    sent, pushed = [], []
    worker = make_worker(rows, sent, pushed)
    worker._client = client = VersionedClient([1, 2, 2])
    worker.on_grant(2)  # two groups running when the learner dies
    await asyncio.sleep(0.05)
    worker.learner_lost()
    client.release.set()
    await asyncio.sleep(0.1)
    assert pushed == [] and [t for t, _ in sent if t == "group_done"] == []  # held: the old learner is gone
    worker.rewind_prompts({"low": 0, "above": []})  # the checkpoint settled none of this worker's prompts
    assert worker._prompts.positions() == {0: 2} and worker._prompts.redraws == 0  # 0 and 1 still run here
    with pytest.raises(ValueError, match="data position"):
        worker.rewind_prompts({"exact": "state"})
    worker.learner_back(1)  # resumed from checkpoint v1
    await settle(worker, lambda: not worker._running)
    done = [p for t, p in sent if t == "group_done"]
    assert sorted(p["reason"] for p in done) == ["accepted", "lost_version"]  # v1 tokens kept, v2 dropped
    assert [p["accepted"] for p in done if p["reason"] == "lost_version"] == [False] and len(pushed) == 1
    assert worker.drop_reasons["lost_version"] == 1
    assert worker._prompts.redraws == 1  # the lost group's prompt is drawn again, not settled
    worker.on_grant(1)  # started after the rollback: its v2 tokens are the new learner's v2
    await settle(worker, lambda: not worker._running)
    assert [p["reason"] for t, p in sent if t == "group_done"][-1] == "accepted" and len(pushed) == 2
    await worker.close()


@pytest.mark.asyncio
async def test_a_group_that_waits_longer_than_the_learner_may_take_to_come_back_is_dropped():
    sent, pushed = [], []
    worker = make_worker([{"id": "p", "mode": "ok"}], sent, pushed)
    worker._learner_wait = 0.05
    worker.learner_lost()
    worker.on_grant(1)
    await settle(worker, lambda: not worker._running)
    assert [p["reason"] for t, p in sent if t == "group_done"] == ["learner_lost"] and pushed == []
