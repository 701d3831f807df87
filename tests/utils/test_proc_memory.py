"""Every heartbeat carries its process's resident memory (`rss_mib`), read fresh each time."""

from __future__ import annotations

import pytest

from arl.transport.control import ControlChannel
from arl.transport.messages import Heartbeat, parse
from arl.utils.proc import rss_mib


def test_rss_is_read_fresh_and_follows_allocations():
    before = rss_mib()
    assert before is not None and before > 10
    block = bytearray(64 * 2**20)  # touched: resident
    block[:: 4096] = b"x" * len(block[:: 4096])
    assert rss_mib() >= before + 48
    del block


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
