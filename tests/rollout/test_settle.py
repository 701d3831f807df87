"""A rollout worker books the prompt position of every group that ended (pushed or dropped), tells the learner
of each rule drop (`prompt_settled`, so a resume does not draw that prompt again), reports what ended in its
heartbeat (a restart of it draws again only the rest), and a rewind does not draw its running groups again."""

from __future__ import annotations

import asyncio

import pytest

from arl.data.position import DataPosition

from .test_guards import make_worker, run_groups


@pytest.mark.asyncio
async def test_drops_are_told_to_the_learner_and_the_heartbeat_says_what_ended():
    rows = [{"id": "ok", "mode": "ok"}, {"id": "raise", "mode": "raise"}, {"id": "hang", "mode": "hang"}]
    sent, pushed, told = [], [], []
    worker = make_worker(rows, sent, pushed)

    async def settled(msg):
        told.append(msg)

    worker._push_settled = settled
    rows_at = {p: worker._prompts.stream(0).row(p)["id"] for p in range(3)}
    await run_groups(worker, 3)
    assert sorted((m.position, m.reason) for m in told) == sorted(
        (p, r) for p, r in ((p, {"raise": "env_error:step:ValueError", "hang": "env_timeout:step"}.get(rows_at[p]))
                            for p in range(3)) if r)
    assert all(m.worker == 0 for m in told) and len(pushed) == 1  # the pushed one settles when trained
    assert DataPosition.from_state(worker.heartbeat_stats()["prompt_position"]["0"]) == DataPosition(3)


@pytest.mark.asyncio
async def test_a_restarted_worker_draws_again_what_had_not_ended_and_a_rewind_skips_running_groups():
    rows = [{"id": i, "mode": "ok"} for i in range(4)]
    sent, pushed = [], []
    worker = make_worker(rows, sent, pushed)
    worker.rewind_prompts({"low": 2, "above": [4]})  # the predecessor's heartbeat: 0, 1 and 4 ended
    await run_groups(worker, 3)
    positions = sorted(g[0].metadata["prompt_pos"][1] for g in pushed)
    assert positions == [2, 3, 5]
    assert DataPosition.from_state(worker.heartbeat_stats()["prompt_position"]["0"]) == DataPosition(6)
    # a rewind while a group runs: that group's position is not drawn again
    hang = make_worker([{"id": "h", "mode": "hang"}, {"id": "h2", "mode": "hang"}], [], [], env_timeout=5.0)
    hang.on_grant(1)  # position 0 runs (its env step hangs)
    await asyncio.sleep(0.05)
    hang.rewind_prompts({"low": 0, "above": []})
    assert hang._prompts.draw()[:2] == (0, 1)
    await hang.close()


@pytest.mark.asyncio
async def test_a_group_lost_with_the_learner_puts_its_prompt_back_and_tells_nobody():
    rows = [{"id": i, "mode": "ok"} for i in range(3)]
    sent, pushed, told = [], [], []
    worker = make_worker(rows, sent, pushed)

    async def settled(msg):
        told.append(msg)

    worker._push_settled = settled
    for reason in ("lost_version", "learner_lost"):
        await worker._settle((0, 1), reason)
    assert told == [] and worker._prompts.draw()[1] == 1 and worker._prompts.draw()[1] == 0
    assert 1 not in DataPosition.from_state(worker.heartbeat_stats()["prompt_position"]["0"])
