"""PromptStream positions: a resumed (or restarted) rollout worker continues its prompt stream exactly."""

from __future__ import annotations

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
