"""PromptStream positions: a resumed (or restarted) rollout worker continues its prompt stream exactly."""

from __future__ import annotations

import asyncio

import pytest

from arl.rollout.worker import PromptStream


@pytest.mark.parametrize("shard,num_shards", [(0, 1), (1, 2), (2, 3)])
def test_seek_continues_the_same_stream(shard, num_shards):
    rows = [{"id": i} for i in range(7)]
    full = PromptStream(rows, seed=3, shard=shard, num_shards=num_shards)
    seq = [next(full)["id"] for _ in range(25)]
    assert full.position == 25
    for p in range(25):
        s = PromptStream(rows, seed=3, shard=shard, num_shards=num_shards)
        s.seek(p)
        assert s.position == p
        assert [next(s)["id"] for _ in range(25 - p)] == seq[p:], p


def test_passes_cover_the_shard_and_seek_is_cheap():
    rows = [{"id": i} for i in range(10)]
    s = PromptStream(rows, seed=0, shard=0, num_shards=2)
    first_pass = {next(s)["id"] for _ in range(5)}
    other = PromptStream(rows, seed=0, shard=1, num_shards=2)
    assert first_pass.isdisjoint({next(other)["id"] for _ in range(5)})  # shards split a pass
    far = PromptStream(rows, seed=0)
    far.seek(10**12)  # no replay: constant time
    assert far.position == 10**12 and isinstance(next(far), dict)
    with pytest.raises(ValueError):
        far.seek(-1)


@pytest.mark.parametrize("shard,num_shards", [(0, 1), (1, 3)])
def test_restore_draws_exactly_the_unsettled_positions_again_then_fresh_ones(shard, num_shards):
    rows = [{"id": i} for i in range(7)]
    full = PromptStream(rows, seed=5, shard=shard, num_shards=num_shards)
    seq = [full.draw() for _ in range(30)]
    assert [p for p, _ in seq] == list(range(30))
    s = PromptStream(rows, seed=5, shard=shard, num_shards=num_shards)
    s.restore({"low": 4, "above": [6, 9, 10]})
    assert s.redraws == 4 and s.position == 11
    got = [s.draw() for _ in range(8)]
    assert [p for p, _ in got] == [4, 5, 7, 8, 11, 12, 13, 14]  # the unsettled ones, then fresh
    assert all(row == seq[p][1] for p, row in got)  # each position's row, as the straight stream drew it


def test_a_rewind_while_groups_run_does_not_draw_theirs_again():
    s = PromptStream([{"id": i} for i in range(5)], seed=0)
    s.restore({"low": 2, "above": [4]}, drawn=[3, 6])  # 3 and 6 still run here
    assert [s.draw()[0] for _ in range(4)] == [2, 5, 7, 8]


def test_a_bad_position_is_refused_by_name():
    s = PromptStream([{"id": 1}], seed=0)
    with pytest.raises(ValueError, match="data position"):
        s.restore({"low": 1, "above": ["x"]})


def test_a_bogus_settled_position_far_ahead_costs_nothing_and_is_skipped_when_reached():
    s = PromptStream([{"id": i} for i in range(5)], seed=0)
    s.restore({"low": 3, "above": [10**12]})  # e.g. a fuzzed notice the learner booked
    assert s.redraws == 10**12 - 3 and [s.draw()[0] for _ in range(3)] == [3, 4, 5]  # drawn lazily, in order
    s.restore({"low": 10**12 - 1, "above": [10**12]})
    assert [s.draw()[0] for _ in range(2)] == [10**12 - 1, 10**12 + 1]


def test_a_stream_added_mid_run_draws_every_row_in_its_own_order():
    rows = [{"id": i} for i in range(12)]
    first = PromptStream(rows, seed=1, shard=0, num_shards=1)
    added = PromptStream(rows, seed=1, shard=1, num_shards=1)  # a worker that joined a 1-worker run
    other = PromptStream(rows, seed=1, shard=2, num_shards=1)
    a, b, c = ([next(s)["id"] for _ in range(12)] for s in (first, added, other))
    assert sorted(a) == sorted(b) == sorted(c) == list(range(12))  # each pass: every row once
    assert len({tuple(a), tuple(b), tuple(c)}) == 3  # not in step with each other
    again = PromptStream(rows, seed=1, shard=1, num_shards=1)
    again.restore({"low": 5, "above": []})
    assert [next(again)["id"] for _ in range(7)] == b[5:]  # exactly resumable, like the first shards


def test_streams_take_turns_and_an_adopted_one_continues_from_its_position():
    from arl.rollout.prompts import PromptStreams

    rows = [{"id": i} for i in range(10)]
    make = lambda sid: PromptStream(rows, seed=4, shard=sid, num_shards=2)  # noqa: E731
    one = make(1)
    straight = [one.draw() for _ in range(8)]
    streams = PromptStreams(make, own=0)
    assert [streams.draw()[:2] for _ in range(2)] == [(0, 0), (0, 1)]
    streams.adopt(1, {"low": 2, "above": [4]})  # worker 1 left: 0, 1 and 4 of its stream ended there
    assert streams.ids == [0, 1] and streams.redraws == 2
    got = [streams.draw() for _ in range(6)]
    assert [g[:2] for g in got] == [(0, 2), (1, 2), (0, 3), (1, 3), (0, 4), (1, 5)]
    assert all(row == straight[p][1] for sid, p, row in got if sid == 1)  # the rows stream 1 had there


@pytest.mark.asyncio
async def test_a_worker_stamps_the_stream_reports_each_and_drains():
    from .test_guards import make_worker, run_groups

    rows = [{"id": i, "mode": "ok"} for i in range(6)]
    sent, pushed = [], []
    worker = make_worker(rows, sent, pushed)
    worker.adopt_streams({"3": {"low": 1, "above": []}})  # a stream of a worker that left
    await run_groups(worker, 4)
    stamps = sorted(tuple(g[0].metadata["prompt_pos"]) for g in pushed)
    assert stamps == [(0, 0), (0, 1), (3, 1), (3, 2)]
    assert worker.heartbeat_stats()["prompt_position"] == {"0": {"low": 2, "above": []},
                                                           "3": {"low": 3, "above": []}}
    with pytest.raises(ValueError, match="stream ids"):
        worker.adopt_streams({"x": 0})
    worker.drain()  # leaving the run: asks for nothing more
    sent.clear()
    task = asyncio.ensure_future(worker.acquire_loop())
    await asyncio.sleep(0.05)
    assert [t for t, _ in sent if t == "gate_acquire"] == []
    task.cancel()
    await worker.close()
