"""Every heartbeat carries its process's resident memory (`rss_mib`), read fresh each time."""

from __future__ import annotations

import mmap

import pytest

from arl.transport.control import ControlChannel
from arl.transport.messages import Heartbeat, parse
from arl.utils.proc import rss_mib


def test_rss_is_read_fresh_and_follows_allocations():
    before = rss_mib()
    assert before is not None and before > 10
    # An anonymous mapping of its own, not malloc: in a long test process the allocator may hand back pages that
    # are already resident (CI saw RSS unchanged after a 64 MiB bytearray), a fresh mapping's pages never are.
    block = mmap.mmap(-1, 64 * 2**20)
    try:
        for off in range(0, len(block), mmap.PAGESIZE):  # touch every page: resident now
            block[off] = 1
        assert rss_mib() >= before + 48
    finally:
        block.close()


@pytest.mark.asyncio
async def test_a_heartbeat_carries_the_role_stats_and_rss():
    ctl = ControlChannel("tcp://127.0.0.1:9", "rollout", 3)  # connect() is lazy: nothing is sent here
    try:
        hb = ctl.beat({"running": 2})
        assert isinstance(hb, Heartbeat) and hb.role == "rollout" and hb.index == 3
        again = parse("heartbeat", hb.to_payload())  # it survives the wire's schema
        assert again.stats["running"] == 2 and again.stats["rss_mib"] > 10
        assert ctl.beat({}, index=5).index == 5
    finally:
        ctl.dealer.close()
